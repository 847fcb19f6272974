"""RMSNorm as an NKI kernel for Trainium: its torch op on the `neuron` device and its simulation.

Written against AWS Neuron SDK 2.33: NKI Beta 2 (the `nki` package, 0.4.x) and TorchNeuron
(torch-neuronx 2.13/2.14). Every NKI / torch_neuronx name below was taken from these sources:
- awsdocs-neuron nki/deep-dives/nki-migration-guide: Beta 2 removed nl.load, nl.store and `mask=`;
  data moves with nisa.dma_copy and a partial tile is a `min(...)`-bounded slice.
- nki/about/tiling-overview: nl.affine_range over ceil(rows / pmax) tiles, slice(start, min(...)),
  nl.ndarray(..., buffer=nl.sbuf | nl.shared_hbm), nl.tile_size.pmax.
- nki/api (v2.33): nki.jit, nki.simulate, NkiTensor.broadcast, nisa.dma_copy, nisa.activation
  (op=nl.square / nl.rsqrt, reduce_op, reduce_res, reduce_cmd=nisa.reduce_cmd.reset_reduce),
  nisa.tensor_reduce(axis, keepdims), nisa.scalar_tensor_tensor.
- aws-neuron/nki-library src/nkilib_src/nkilib/core/subkernels/rmsnorm_tkg.py: the same Beta 2 ops
  for RMSNorm (square + add-reduce, rsqrt activation with scale=1/H and bias=eps, HBM broadcast).
- torch/guides/how-to-work-with-nki, torch/get-started/quickstart-nki-kernel and the torch-neuronx
  README ("Using NKI kernels in torch code"): nki.jit kernel -> torch_neuronx.wrap_nki ->
  torch_neuronx.nki_op(name, mutates_args={}); eager calls compile per shape and constant args.
- torch/reference/api/torch-neuron-module: torch.neuron.is_available().
"""

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .nki_tiling import ceil_div, param_error, span

TUNABLES: dict[str, tuple[int, ...]] = {
    "rows_per_tile": (32, 64, 128),  # at most nl.tile_size.pmax partitions
    # Elements per chunk: even 4096 makes four fp32 chunk buffers use 64 of 192 KiB per partition.
    "free_chunk": (512, 1024, 2048, 4096),
}

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NOT_ON_PYPI = "it comes from AWS's Neuron repository, not PyPI"

# Bound by _jit_kernel(): the NKI compiler resolves a kernel's names as module globals.
nl: Any = None
nisa: Any = None


def _rmsnorm_kernel(x: Any, w: Any, eps: float, rows_per_tile: int, free_chunk: int) -> Any:
    """out[r] = x[r] * rsqrt(mean(x[r]**2) + eps) * w[0]; x is [rows, hidden], w is [1, hidden]."""
    rows, hidden = x.shape
    parts = min(rows_per_tile, rows)
    chunk = min(free_chunk, hidden)
    n_chunks = ceil_div(hidden, chunk)
    out = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.shared_hbm)

    # One DMA replicates the weight row onto every partition; it stays resident for all tiles.
    w_sb = nl.ndarray((parts, hidden), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w.broadcast(dim=0, size=parts))

    for t in nl.affine_range(ceil_div(rows, rows_per_tile)):
        r0, r1 = span(t, rows_per_tile, rows)
        n = r1 - r0  # the last tile uses partitions [0, n) only, in place of a mask

        # Pass 1: each chunk's fp32 sum of squares lands in its own column, so the chunks
        # carry no dependency on one another and the loop can stay an affine_range.
        partial = nl.ndarray((parts, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in nl.affine_range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            x_sb = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)
            # activation must write the squares somewhere; only their reduction is kept.
            squares = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb[0:n, 0 : c1 - c0], src=x[r0:r1, c0:c1])
            nisa.activation(
                dst=squares[0:n, 0 : c1 - c0],
                op=nl.square,
                data=x_sb[0:n, 0 : c1 - c0],
                reduce_op=nl.add,
                reduce_res=partial[0:n, c : c + 1],
                reduce_cmd=nisa.reduce_cmd.reset_reduce,
            )
        total = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(
            dst=total[0:n, :], op=nl.add, data=partial[0:n, :], axis=1, keepdims=True
        )
        rstd = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(
            dst=rstd[0:n, :], op=nl.rsqrt, data=total[0:n, :], scale=1.0 / hidden, bias=eps
        )

        # Pass 2: x is read again chunk by chunk, so SBUF use does not grow with hidden
        # beyond the resident weight.
        for c in nl.affine_range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            x_sb = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)
            y_sb = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb[0:n, 0 : c1 - c0], src=x[r0:r1, c0:c1])
            nisa.scalar_tensor_tensor(
                dst=y_sb[0:n, 0 : c1 - c0],
                data=x_sb[0:n, 0 : c1 - c0],
                op0=nl.multiply,
                operand0=rstd[0:n, :],
                op1=nl.multiply,
                operand1=w_sb[0:n, c0:c1],
            )
            nisa.dma_copy(dst=out[r0:r1, c0:c1], src=y_sb[0:n, 0 : c1 - c0])
    return out


def _nki_problem(*extra: str) -> str | None:
    """Why the real `nki` package (with `extra` top-level names) is unusable, or None."""
    try:
        import nki
        import nki.isa
        import nki.language
    except ModuleNotFoundError as exc:
        if exc.name == "nki":
            return f"nki is not installed ({_NOT_ON_PYPI})"
        return f"nki is incomplete, likely the PyPI placeholder ({exc}); {_NOT_ON_PYPI}"
    except Exception as exc:  # a broken install must not crash whoever asks
        return f"nki failed to import: {exc}"
    needed = {
        nki: ("jit", *extra),
        nki.language: ("ndarray", "affine_range", "tile_size", "sbuf", "shared_hbm"),
        nki.isa: ("dma_copy", "activation", "tensor_reduce", "scalar_tensor_tensor", "reduce_cmd"),
    }
    missing = [
        f"{m.__name__}.{a}" for m, names in needed.items() for a in names if not hasattr(m, a)
    ]
    if missing:
        return (
            f"nki lacks {', '.join(missing)}: it is the PyPI placeholder or not the NKI Beta 2 "
            f"release this kernel targets (Neuron SDK 2.33); {_NOT_ON_PYPI}"
        )
    return None


def unavailable_reason() -> str | None:
    """Why rms_norm_nki cannot run here; None when torch-neuronx, nki and a device are present."""
    try:
        import torch_neuronx
    except ModuleNotFoundError as exc:
        if exc.name == "torch_neuronx":
            return f"torch-neuronx is not installed ({_NOT_ON_PYPI})"
        return f"torch-neuronx failed to import: {exc}"
    except Exception as exc:  # a broken install must not crash whoever asks
        return f"torch-neuronx failed to import: {exc}"
    if not all(hasattr(torch_neuronx, name) for name in ("nki_op", "wrap_nki")):
        return (
            "torch-neuronx has no nki_op/wrap_nki: it is the PyPI placeholder or predates "
            f"TorchNeuron 2.13; {_NOT_ON_PYPI}"
        )
    problem = _nki_problem()
    if problem is not None:
        return problem
    neuron = getattr(torch, "neuron", None)
    if neuron is None:
        return "torch.neuron is missing: torch-neuronx did not register the neuron device"
    try:
        available = bool(neuron.is_available())
    except Exception as exc:  # the runtime can fail without a driver; report, don't raise
        return f"torch.neuron.is_available() failed: {exc}"
    if not available:
        return "no Neuron device: torch.neuron.is_available() is False (needs Trn2 or Trn3)"
    return None


def simulator_unavailable_reason() -> str | None:
    """Why simulate_rms_norm cannot run here (it needs nki.simulate), or None if it can."""
    return _nki_problem("simulate")


@functools.cache
def _jit_kernel() -> Any:
    global nl, nisa
    import nki
    import nki.isa
    import nki.language

    nl, nisa = nki.language, nki.isa
    return nki.jit(_rmsnorm_kernel)


@functools.cache
def _torch_op() -> Callable[..., torch.Tensor]:
    from torch_neuronx import nki_op, wrap_nki

    kernel = wrap_nki(_jit_kernel())

    @nki_op("fusionlab::rms_norm_nki", mutates_args={})
    def rms_norm_nki_op(
        x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_tile: int, free_chunk: int
    ) -> torch.Tensor:
        return kernel(x, weight, eps, rows_per_tile, free_chunk)

    return rms_norm_nki_op


def _rows_and_hidden(shape: tuple[int, ...], weight_shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        raise ValueError("x must have at least one dimension")
    hidden = shape[-1]
    if weight_shape != (hidden,):
        raise ValueError(f"weight shape {weight_shape} != ({hidden},)")
    return (int(np.prod(shape[:-1], dtype=np.int64)), hidden)


def _validated(
    shape: tuple[int, ...], weight_shape: tuple[int, ...], rows_per_tile: int, free_chunk: int
) -> tuple[int, int]:
    rows, hidden = _rows_and_hidden(shape, weight_shape)
    error = param_error(rows, hidden, rows_per_tile, free_chunk)
    if error is not None:
        raise ValueError(error)
    return rows, hidden


def rms_norm_nki(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, rows_per_tile: int, free_chunk: int
) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (on the neuron device) with the NKI kernel, eager."""
    rows, hidden = _validated(tuple(x.shape), tuple(weight.shape), rows_per_tile, free_chunk)
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {_SUPPORTED_DTYPES}")
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    if x.device.type != "neuron" or weight.device != x.device:
        raise ValueError(
            f"x and weight must be on one neuron device, got {x.device}/{weight.device}"
        )
    x2d = x.reshape(rows, hidden).contiguous()
    w2d = weight.reshape(1, hidden).contiguous()
    out = _torch_op()(x2d, w2d, float(eps), rows_per_tile, free_chunk)
    return out.reshape(x.shape)


def simulate_rms_norm(
    x_np: np.ndarray, w_np: np.ndarray, eps: float, *, rows_per_tile: int, free_chunk: int
) -> np.ndarray:
    """Run the same kernel in NKI's CPU simulator (nki.simulate) on NumPy arrays."""
    rows, hidden = _validated(x_np.shape, w_np.shape, rows_per_tile, free_chunk)
    reason = simulator_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import nki

    x2d = np.ascontiguousarray(x_np.reshape(rows, hidden))
    w2d = np.ascontiguousarray(w_np.reshape(1, hidden))
    out = nki.simulate(_jit_kernel())(x2d, w2d, float(eps), rows_per_tile, free_chunk)
    return np.asarray(out).reshape(x_np.shape)

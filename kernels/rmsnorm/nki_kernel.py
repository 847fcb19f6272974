"""RMSNorm as an NKI kernel for Trainium: the torch op on `neuron`, the simulator, the CPU model.

y = x * rsqrt(mean(x**2) + eps) * weight over the last dim, fp32 statistics, y in x.dtype.
Written against Neuron SDK 2.33: NKI 0.7.0 and torch-neuronx 2.14. Signatures of every call below
are the official ones in aws-neuron/aws-neuron-sdk nki/api/nki/{isa,language}/__init__.py
(SDK 2.32 stubs; see kernels/nki_replay.py): nl.ndarray(shape, dtype, buffer, ...),
nl.program_id(axis), nl.num_programs(axes), NkiTensor.broadcast(dim, size),
nisa.dma_copy(dst, src, ...), nisa.memset(dst, value, ...), nisa.activation(dst, op, data, bias,
scale, reduce_op, reduce_res, reduce_cmd, ...), nisa.tensor_reduce(dst, op, data, axis, negate,
keepdims, ...), nisa.scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, ...).
The recipe follows aws-neuron/nki-library src/nkilib_src/nkilib/core/rmsnorm/rmsnorm_quant.py
(NKI Lib 2026-04-13): the x tile stays in SBUF; square with add-reduce into an fp32 (P, 1) tile;
rsqrt with scale=1/H and a (P, 1) eps tile filled by nisa.memset (a scalar `bias=` is valid only
from NeuronCore-v3 on, per the nisa.activation docstring); one fused multiply by rstd and weight.
Rows are shared among LNC programs by nl.program_id / nl.num_programs (nki/get-started/about/lnc).
Loops are plain `range`: NKI 0.7.0 traces kernels as Python and nl.affine_range is deprecated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fusionlab.kernels import nki_common, nki_replay
from fusionlab.kernels.nki_common import ceil_div, program_rows, span, tile_partitions
from fusionlab.kernels.rmsnorm import nki_tiling
from fusionlab.kernels.rmsnorm.nki_tiling import FREE_CHUNKS, Plan

TUNABLES: dict[str, tuple[Any, ...]] = {
    "free_chunk": FREE_CHUNKS,
    "lnc_split": nki_common.LNC_SPLITS,
}
# Exactly the nki.language / nki.isa names the kernel uses: the availability check asks for these
# and the CPU model offers only these.
NL_NAMES = ("ndarray", "sbuf", "shared_hbm", "float32", "program_id", "num_programs", "tile_size",
            "square", "rsqrt", "add", "multiply")
NISA_NAMES = ("dma_copy", "memset", "activation", "tensor_reduce", "scalar_tensor_tensor",
              "reduce_cmd")

# Bound by nki_common.bind_language() (or by the CPU model): NKI resolves these as module globals.
nl: Any = None
nisa: Any = None


def _rmsnorm_kernel(x: Any, w: Any, eps: float, free_chunk: int, lnc_split: str,
                    resident: bool) -> Any:
    """out[r] = x[r] * rsqrt(mean(x[r]**2) + eps) * w[0]; x is [rows, hidden], w is [1, hidden]."""
    rows, hidden = x.shape
    out = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    programs = nl.num_programs(0)
    first, stop = program_rows(rows, lnc_split, nl.program_id(0), programs)
    if stop == first:
        return out  # this program has no rows (lnc_split="none", or fewer rows than programs)
    parts = tile_partitions(rows, lnc_split, programs)
    assert parts <= nl.tile_size.pmax
    chunk = min(free_chunk, hidden)
    n_chunks = ceil_div(hidden, chunk)

    # Loaded once per program and kept: the weight row on every partition, and eps as a (P, 1)
    # bias tile, which every NeuronCore generation accepts.
    w_sb = nl.ndarray((parts, hidden), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w.broadcast(0, parts))
    eps_sb = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_sb, value=eps)

    for t in range(ceil_div(stop - first, parts)):
        t0, t1 = span(t, parts, stop - first)
        r0, r1, n = first + t0, first + t1, t1 - t0  # partitions [0, n) hold rows [r0, r1)
        x_sb = nl.ndarray((parts, hidden), dtype=x.dtype, buffer=nl.sbuf) if resident else None

        # Pass 1: each chunk's fp32 sum of squares lands in its own column, so chunks do not
        # wait on one another; a resident x chunk is loaded once and reused in pass 2.
        partial = nl.ndarray((parts, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            if resident:
                x_c = x_sb[0:n, c0:c1]
            else:
                x_c = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)[0:n, 0 : c1 - c0]
            nisa.dma_copy(dst=x_c, src=x[r0:r1, c0:c1])
            squares = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=squares[0:n, 0 : c1 - c0], op=nl.square, data=x_c,
                            reduce_op=nl.add, reduce_res=partial[0:n, c : c + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
        if n_chunks == 1:
            total = partial
        else:
            total = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=total[0:n, :], op=nl.add, data=partial[0:n, :], axis=1,
                               keepdims=True)
        rstd = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd[0:n, :], op=nl.rsqrt, data=total[0:n, :], bias=eps_sb[0:n, :],
                        scale=1.0 / hidden)

        # Pass 2: y = (x * rstd) * w, written over the x chunk it came from, then stored.
        for c in range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            if resident:
                x_c = x_sb[0:n, c0:c1]
            else:  # the streamed plan reads x a second time (Plan.x_reads == 2)
                x_c = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)[0:n, 0 : c1 - c0]
                nisa.dma_copy(dst=x_c, src=x[r0:r1, c0:c1])
            nisa.scalar_tensor_tensor(dst=x_c, data=x_c, op0=nl.multiply, operand0=rstd[0:n, :],
                                      op1=nl.multiply, operand1=w_sb[0:n, c0:c1])
            nisa.dma_copy(dst=out[r0:r1, c0:c1], src=x_c)
    return out


def param_error(shape: tuple[int, ...], **params: Any) -> str | None:
    """Why these tunables cannot run at `shape` (any dtype, any generation), or None."""
    return nki_common.shape_param_error(nki_tiling, TUNABLES, shape, params)


def unavailable_reason() -> str | None:
    """Why rms_norm_nki cannot run here; None when torch-neuronx, nki and a device are present."""
    return nki_common.torch_neuron_problem(NL_NAMES, NISA_NAMES)


def simulator_unavailable_reason() -> str | None:
    """Why simulate_rms_norm cannot run here (it needs the real nki.simulate), or None."""
    return nki_common.nki_problem(NL_NAMES, NISA_NAMES, "simulate")


@functools.cache
def _jit_kernel() -> Any:
    return nki_common.bind_language(globals()).jit(_rmsnorm_kernel)


@functools.cache
def _torch_op(lnc: int) -> Callable[..., torch.Tensor]:
    from torch_neuronx import nki_op

    kernel = nki_common.launch(_jit_kernel(), lnc)

    @nki_op(f"fusionlab::rms_norm_nki_lnc{lnc}", mutates_args={})
    def rms_norm_nki_op(x: torch.Tensor, weight: torch.Tensor, eps: float, free_chunk: int,
                        lnc_split: str, resident: bool) -> torch.Tensor:
        return kernel(x, weight, eps, free_chunk, lnc_split, resident)

    return rms_norm_nki_op


def rms_norm_nki(x: torch.Tensor, weight: torch.Tensor, eps: float, *, free_chunk: int,
                 lnc_split: str) -> torch.Tensor:
    """RMSNorm over the last dim of `x` on the neuron device, eager, at the runtime's LNC degree.

    Rows that are not contiguous are copied by `.contiguous()` first; that copy is part of the
    kernel's cost.
    """
    if tuple(weight.shape) != tuple(x.shape[-1:]):
        raise ValueError(f"weight shape {tuple(weight.shape)} != {tuple(x.shape[-1:])}")
    lnc, _ = nki_common.lnc_degree()
    plan = nki_common.shape_plan(nki_tiling, tuple(x.shape), nki_common.dtype_name(x.dtype),
                                 lnc=lnc, generation=nki_common.generation(),
                                 free_chunk=free_chunk, lnc_split=lnc_split)
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    nki_common.check_devices(x, weight)
    x2d = x.reshape(plan.rows, plan.hidden).contiguous()
    w2d = weight.reshape(1, plan.hidden).contiguous()
    out = _torch_op(lnc)(x2d, w2d, float(eps), free_chunk, lnc_split, plan.resident)
    return out.reshape(x.shape)


def simulate_rms_norm(x_np: np.ndarray, w_np: np.ndarray, eps: float, *, lnc: int,
                      **tunables: Any) -> np.ndarray:
    """Run the kernel in AWS's CPU simulator, nki.simulate(kernel[lnc]), on float32 arrays."""
    plan = nki_common.shape_plan(nki_tiling, x_np.shape, "float32", lnc=lnc,
                                 generation=nki_common.generation(), **tunables)
    reason = simulator_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import nki

    kernel = nki_common.launch(_jit_kernel(), lnc)
    x2d = np.ascontiguousarray(x_np.reshape(plan.rows, plan.hidden))
    out = nki.simulate(kernel)(x2d, w_np.reshape(1, -1), float(eps), tunables["free_chunk"],
                               tunables["lnc_split"], plan.resident)
    return np.asarray(out).reshape(x_np.shape)


def replay_rms_norm(x_np: np.ndarray, w_np: np.ndarray, eps: float, *, dtype: str, lnc: int,
                    generation: str, **tunables: Any) -> tuple[np.ndarray, nki_replay.Replay, Plan]:
    """Run the kernel's real body in the NumPy MODEL of NKI (nki_replay), not on hardware."""
    plan = nki_common.shape_plan(nki_tiling, x_np.shape, dtype, lnc=lnc, generation=generation,
                                 **tunables)
    result = nki_replay.replay(
        _rmsnorm_kernel,
        [(x_np.reshape(plan.rows, plan.hidden), dtype), (w_np.reshape(1, -1), dtype)],
        [float(eps), tunables["free_chunk"], tunables["lnc_split"], plan.resident],
        lnc=lnc, generation=generation, nl_names=NL_NAMES, nisa_names=NISA_NAMES)
    return result.outputs[0].reshape(x_np.shape), result, plan

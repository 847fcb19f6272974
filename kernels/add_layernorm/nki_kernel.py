"""Fused residual add + LayerNorm as an NKI kernel: the torch op on `neuron`, simulator, CPU model.

residual_out = x + residual (formed in fp32, stored as x.dtype); out = layernorm(residual_out) *
weight + bias, computed from the fp32 sum with the biased variance. x and residual are read from
HBM once and both results written once: they stream through SBUF chunk by chunk while the fp32
sum row stays resident for the variance and output passes. The variance is two-pass on that
resident row, sum((s - mean)^2) via an activation whose (P, 1) bias is -mean, as
kernels/layernorm/nki_kernel.py does. A hidden size whose fp32 row does not fit is rejected by
`param_error` (re-reading the rounded residual_out would change the numbers). Written against
Neuron SDK 2.33 (NKI 0.7.0, torch-neuronx 2.14); signatures as in kernels/add_rmsnorm/nki_kernel.py
and kernels/layernorm/nki_kernel.py. Checked only in the NumPy model (kernels/nki_replay.py) and,
where `nki` is installed, AWS's simulator; never on Trainium here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fusionlab.kernels import nki_common, nki_replay
from fusionlab.kernels.nki_common import (
    FP32_BYTES,
    FREE_CHUNKS,
    Plan,
    ceil_div,
    program_rows,
    span,
    tile_partitions,
)

TUNABLES: dict[str, tuple[Any, ...]] = {
    "free_chunk": FREE_CHUNKS,
    "lnc_split": nki_common.LNC_SPLITS,
}
NL_NAMES = ("ndarray", "sbuf", "shared_hbm", "float32", "program_id", "num_programs", "tile_size",
            "copy", "square", "rsqrt", "add", "multiply")
NISA_NAMES = ("dma_copy", "memset", "activation", "tensor_reduce", "tensor_scalar",
              "tensor_tensor", "scalar_tensor_tensor", "reduce_cmd")

nl: Any = None
nisa: Any = None


def _add_layernorm_kernel(x: Any, r: Any, w: Any, b: Any, eps: float, free_chunk: int,
                          lnc_split: str) -> Any:
    """(out, residual_out) for x, r [rows, hidden] and w, b [1, hidden]."""
    rows, hidden = x.shape
    out = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    res_out = nl.ndarray((rows, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    programs = nl.num_programs(0)
    first, stop = program_rows(rows, lnc_split, nl.program_id(0), programs)
    if stop == first:
        return out, res_out
    parts = tile_partitions(rows, lnc_split, programs)
    assert parts <= nl.tile_size.pmax
    chunk = min(free_chunk, hidden)
    n_chunks = ceil_div(hidden, chunk)

    w_sb = nl.ndarray((parts, hidden), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w.broadcast(0, parts))
    b_sb = nl.ndarray((parts, hidden), dtype=b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=b_sb, src=b.broadcast(0, parts))
    eps_sb = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_sb, value=eps)

    for t in range(ceil_div(stop - first, parts)):
        t0, t1 = span(t, parts, stop - first)
        r0, r1, n = first + t0, first + t1, t1 - t0
        total_sb = nl.ndarray((parts, hidden), dtype=nl.float32, buffer=nl.sbuf)

        def row_sums(partial: Any, n: int = n) -> Any:
            if n_chunks == 1:
                return partial
            summed = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=summed[0:n, :], op=nl.add, data=partial[0:n, :], axis=1,
                               keepdims=True)
            return summed

        # Pass 1: the fp32 sum (kept), residual_out in x.dtype (stored), sum of the sum -> -mean.
        sums = nl.ndarray((parts, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            x_c = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)[0:n, 0 : c1 - c0]
            r_c = nl.ndarray((parts, chunk), dtype=r.dtype, buffer=nl.sbuf)[0:n, 0 : c1 - c0]
            nisa.dma_copy(dst=x_c, src=x[r0:r1, c0:c1])
            nisa.dma_copy(dst=r_c, src=r[r0:r1, c0:c1])
            s_c = total_sb[0:n, c0:c1]
            nisa.tensor_tensor(dst=s_c, data1=x_c, data2=r_c, op=nl.add)
            nisa.tensor_tensor(dst=r_c, data1=x_c, data2=r_c, op=nl.add)  # rounded once
            nisa.dma_copy(dst=res_out[r0:r1, c0:c1], src=r_c)
            scratch = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=scratch[0:n, 0 : c1 - c0], op=nl.copy, data=s_c, reduce_op=nl.add,
                            reduce_res=sums[0:n, c : c + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
        neg_mean = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg_mean[0:n, :], data=row_sums(sums)[0:n, :], op0=nl.multiply,
                           operand0=-1.0 / hidden)

        # Pass 2: sum((s - mean)^2) per row from the resident sum -> rstd.
        squares = nl.ndarray((parts, n_chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            scratch = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=scratch[0:n, 0 : c1 - c0], op=nl.square,
                            data=total_sb[0:n, c0:c1], bias=neg_mean[0:n, :], reduce_op=nl.add,
                            reduce_res=squares[0:n, c : c + 1],
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rstd = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd[0:n, :], op=nl.rsqrt, data=row_sums(squares)[0:n, :],
                        bias=eps_sb[0:n, :], scale=1.0 / hidden)

        # Pass 3: out = ((s - mean) * w) * rstd + b from the resident sum, then stored.
        for c in range(n_chunks):
            c0, c1 = span(c, chunk, hidden)
            centred = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=centred[0:n, 0 : c1 - c0], data=total_sb[0:n, c0:c1],
                                      op0=nl.add, operand0=neg_mean[0:n, :], op1=nl.multiply,
                                      operand1=w_sb[0:n, c0:c1])
            y_c = nl.ndarray((parts, chunk), dtype=x.dtype, buffer=nl.sbuf)[0:n, 0 : c1 - c0]
            nisa.scalar_tensor_tensor(dst=y_c, data=centred[0:n, 0 : c1 - c0], op0=nl.multiply,
                                      operand0=rstd[0:n, :], op1=nl.add,
                                      operand1=b_sb[0:n, c0:c1])
            nisa.dma_copy(dst=out[r0:r1, c0:c1], src=y_c)
    return out, res_out


def sbuf_bytes(hidden: int, chunk: int, x_bytes: int, w_bytes: int, resident: bool) -> int:
    """Upper bound of SBUF bytes per partition; the fp32 sum row is always resident."""
    del resident  # one layout only: see the module docstring
    resident_rows = hidden * (2 * w_bytes + FP32_BYTES)  # weight, bias and the fp32 sum
    n_chunks = ceil_div(hidden, chunk)
    # x and residual chunks (out's chunk reuses their space in pass 3), twice over when there is
    # a next chunk to prefetch; two fp32 chunks (the reduction-only activation output, centred).
    streamed = (2 if n_chunks > 1 else 1) * 2 * chunk * x_bytes + 2 * chunk * FP32_BYTES
    stats = (2 * n_chunks + 6) * FP32_BYTES  # partial sums, totals, -mean, rstd, eps
    return resident_rows + streamed + stats


class _Tiling:
    """The (rows, hidden) plan interface nki_common.shape_plan / shape_param_error expect."""

    @staticmethod
    def make_plan(rows: int, hidden: int, free_chunk: int, lnc_split: str, *, lnc: int,
                  budget: int, x_bytes: int, w_bytes: int) -> Plan:
        error = _Tiling.param_error(rows, hidden, free_chunk, lnc_split)
        if error is not None:
            raise ValueError(error)
        plan = nki_common.choose_plan(
            rows, hidden, free_chunk, lnc_split, lnc=lnc, budget=budget,
            need=lambda c, res: sbuf_bytes(hidden, c, x_bytes, w_bytes, res), streamed_reads=1)
        if not plan.resident:
            raise ValueError(f"hidden {hidden}: the fp32 sum row does not fit {budget} bytes")
        return plan

    @staticmethod
    def param_error(rows: int, hidden: int, free_chunk: int, lnc_split: str) -> str | None:
        sizes = nki_common.rows_and_hidden((rows, hidden))
        if isinstance(sizes, str):
            return sizes
        return nki_common.tunable_error(free_chunk, lnc_split, FREE_CHUNKS) or (
            nki_common.budget_error(
                hidden, free_chunk,
                lambda c, res: sbuf_bytes(hidden, c, FP32_BYTES, FP32_BYTES, res)))


def param_error(shape: tuple[int, ...], **params: Any) -> str | None:
    """Why these tunables cannot run at `shape` (any dtype, any generation), or None."""
    return nki_common.shape_param_error(_Tiling, TUNABLES, shape, params)


def make_plan(rows: int, hidden: int, free_chunk: int, lnc_split: str, *, lnc: int, budget: int,
              x_bytes: int, w_bytes: int) -> Plan:
    """The plan for these sizes; ValueError when the fp32 sum row does not fit `budget`."""
    return _Tiling.make_plan(rows, hidden, free_chunk, lnc_split, lnc=lnc, budget=budget,
                             x_bytes=x_bytes, w_bytes=w_bytes)


def unavailable_reason() -> str | None:
    """Why add_layer_norm_nki cannot run here; None with torch-neuronx, nki and a device."""
    return nki_common.torch_neuron_problem(NL_NAMES, NISA_NAMES)


def simulator_unavailable_reason() -> str | None:
    """Why simulate_add_layer_norm cannot run here (it needs the real nki.simulate), or None."""
    return nki_common.nki_problem(NL_NAMES, NISA_NAMES, "simulate")


@functools.cache
def _jit_kernel() -> Any:
    return nki_common.bind_language(globals()).jit(_add_layernorm_kernel)


@functools.cache
def _torch_op(lnc: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from torch_neuronx import nki_op

    kernel = nki_common.launch(_jit_kernel(), lnc)

    @nki_op(f"fusionlab::add_layer_norm_nki_lnc{lnc}", mutates_args={})
    def add_layer_norm_nki_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor, eps: float, free_chunk: int,
                              lnc_split: str) -> tuple[torch.Tensor, torch.Tensor]:
        return kernel(x, residual, weight, bias, eps, free_chunk, lnc_split)

    return add_layer_norm_nki_op


def add_layer_norm_nki(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, eps: float, *, free_chunk: int,
                       lnc_split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(layernorm(x + residual), x + residual) on the neuron device, eager, at the runtime's LNC.

    Rows that are not contiguous are copied by `.contiguous()` first, as part of the kernel's cost.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} must match x "
                         f"{tuple(x.shape)}/{x.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if tuple(t.shape) != tuple(x.shape[-1:]):
            raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(x.shape[-1:])}")
    lnc, _ = nki_common.lnc_degree()
    plan = nki_common.shape_plan(_Tiling, tuple(x.shape), nki_common.dtype_name(x.dtype),
                                 lnc=lnc, generation=nki_common.generation(),
                                 free_chunk=free_chunk, lnc_split=lnc_split)
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    nki_common.check_devices(x, residual, weight, bias)
    rows_shape = (plan.rows, plan.hidden)
    out, res_out = _torch_op(lnc)(x.reshape(rows_shape).contiguous(),
                                  residual.reshape(rows_shape).contiguous(),
                                  weight.reshape(1, -1).contiguous(),
                                  bias.reshape(1, -1).contiguous(), float(eps), free_chunk,
                                  lnc_split)
    return out.reshape(x.shape), res_out.reshape(x.shape)


def simulate_add_layer_norm(x_np: np.ndarray, r_np: np.ndarray, w_np: np.ndarray,
                            b_np: np.ndarray, eps: float, *, lnc: int,
                            **tunables: Any) -> tuple[np.ndarray, np.ndarray]:
    """Run the kernel in AWS's CPU simulator, nki.simulate(kernel[lnc]), on float32 arrays."""
    plan = nki_common.shape_plan(_Tiling, x_np.shape, "float32", lnc=lnc,
                                 generation=nki_common.generation(), **tunables)
    reason = simulator_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    import nki

    kernel = nki_common.launch(_jit_kernel(), lnc)
    rows_shape = (plan.rows, plan.hidden)
    out, res_out = nki.simulate(kernel)(
        np.ascontiguousarray(x_np.reshape(rows_shape)),
        np.ascontiguousarray(r_np.reshape(rows_shape)), w_np.reshape(1, -1),
        b_np.reshape(1, -1), float(eps), tunables["free_chunk"], tunables["lnc_split"])
    return np.asarray(out).reshape(x_np.shape), np.asarray(res_out).reshape(x_np.shape)


def replay_add_layer_norm(
    x_np: np.ndarray, r_np: np.ndarray, w_np: np.ndarray, b_np: np.ndarray, eps: float, *,
    dtype: str, lnc: int, generation: str, **tunables: Any,
) -> tuple[np.ndarray, np.ndarray, nki_replay.Replay, Plan]:
    """Run the kernel's real body in the NumPy MODEL of NKI (nki_replay), not on hardware."""
    plan = nki_common.shape_plan(_Tiling, x_np.shape, dtype, lnc=lnc, generation=generation,
                                 **tunables)
    rows_shape = (plan.rows, plan.hidden)
    result = nki_replay.replay(
        _add_layernorm_kernel,
        [(x_np.reshape(rows_shape), dtype), (r_np.reshape(rows_shape), dtype),
         (w_np.reshape(1, -1), dtype), (b_np.reshape(1, -1), dtype)],
        [float(eps), tunables["free_chunk"], tunables["lnc_split"]],
        lnc=lnc, generation=generation, nl_names=NL_NAMES, nisa_names=NISA_NAMES)
    out, res_out = (o.reshape(x_np.shape) for o in result.outputs)
    return out, res_out, result, plan

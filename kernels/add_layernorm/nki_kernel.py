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

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from fusionlab.kernels import nki_replay
from fusionlab.kernels import nki_tiles as tiles
from fusionlab.kernels.nki_common import FP32_BYTES, Plan, ceil_div
from fusionlab.kernels.nki_ops import TUNABLES, NkiKernel
from fusionlab.kernels.nki_plans import Tiling

__all__ = ["TUNABLES", "add_layer_norm_nki", "make_plan", "param_error", "replay_add_layer_norm",
           "sbuf_bytes", "simulate_add_layer_norm", "simulator_unavailable_reason",
           "unavailable_reason"]
NL_NAMES = ("ndarray", "sbuf", "shared_hbm", "float32", "program_id", "num_programs", "tile_size",
            "copy", "square", "rsqrt", "add", "multiply")
NISA_NAMES = ("dma_copy", "memset", "activation", "tensor_reduce", "tensor_scalar",
              "tensor_tensor", "scalar_tensor_tensor", "reduce_cmd")

Pair = tuple[torch.Tensor, torch.Tensor]
nl: Any = None
nisa: Any = None


def _add_layernorm_kernel(x: Any, r: Any, w: Any, b: Any, eps: float, free_chunk: int,
                          lnc_split: str) -> Any:
    """(out, residual_out) for x, r [rows, hidden] and w, b [1, hidden]."""
    out, res_out = tiles.hbm_like(nl, x), tiles.hbm_like(nl, x)
    grid, (w_sb, b_sb), eps_sb = tiles.program_start(nl, nisa, x, free_chunk, lnc_split, eps, w, b)
    if grid.empty:
        return out, res_out
    parts, chunk = grid.parts, grid.chunk

    for rows in grid.tiles():
        n = rows[2]
        total_sb = tiles.resident_row(nl, grid, nl.float32)

        # Pass 1: the fp32 sum (kept), residual_out in x.dtype (stored), sum of the sum -> -mean.
        add = partial(tiles.residual_sum, nl, nisa, grid, x, r, res_out, total_sb, rows)
        sums = tiles.row_sums(nl, nisa, grid, nl.copy, add, rows)
        neg_mean = tiles.neg_mean_tile(nl, nisa, grid, sums, n)

        # Pass 2: sum((s - mean)^2) per row from the resident sum -> rstd.
        kept_sum = partial(tiles.chunk_tile, nl, nisa, grid, x, rows, resident=total_sb, load=False)
        squares = tiles.row_sums(nl, nisa, grid, nl.square, kept_sum, rows, bias=neg_mean[0:n, :])
        rstd = tiles.rstd_tile(nl, nisa, grid, squares, eps_sb, n)

        # Pass 3: out = ((s - mean) * w) * rstd + b from the resident sum, then stored.
        for _, c0, c1 in grid.chunks():
            centred = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=centred[0:n, 0 : c1 - c0], data=total_sb[0:n, c0:c1],
                                      op0=nl.add, operand0=neg_mean[0:n, :], op1=nl.multiply,
                                      operand1=w_sb[0:n, c0:c1])
            y_c = tiles.chunk_tile(nl, nisa, grid, x, rows, c0, c1, load=False)
            tiles.store_fused(nisa, out, rows, c0, c1, y_c, data=centred[0:n, 0 : c1 - c0],
                              op0=nl.multiply, operand0=rstd[0:n, :], op1=nl.add,
                              operand1=b_sb[0:n, c0:c1])
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


TILING = Tiling(sbuf_bytes, streamed_reads=1, resident_only=True)
make_plan = TILING.make_plan


def _register_op(kernel: Callable[..., Any], lnc: int) -> Callable[..., Pair]:
    """`kernel`, launched at LNC degree `lnc`, as this module's torch op on `neuron`."""
    from torch_neuronx import nki_op

    @nki_op(f"fusionlab::add_layer_norm_nki_lnc{lnc}", mutates_args={})
    def add_layer_norm_nki_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor, eps: float, free_chunk: int,
                              lnc_split: str) -> Pair:
        return kernel(x, residual, weight, bias, eps, free_chunk, lnc_split)

    return add_layer_norm_nki_op


KERNEL = NkiKernel(_add_layernorm_kernel, globals(), TILING, _register_op)
param_error = KERNEL.param_error
unavailable_reason = KERNEL.unavailable_reason
simulator_unavailable_reason = KERNEL.simulator_unavailable_reason


def add_layer_norm_nki(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, eps: float, *, free_chunk: int,
                       lnc_split: str) -> Pair:
    """(layernorm(x + residual), x + residual) on the neuron device, eager, at the runtime's LNC
    (NkiKernel.on_device: non-contiguous rows are copied first, as part of the kernel's cost)."""
    out, res_out = KERNEL.on_device([x, residual], {"weight": weight, "bias": bias},
                                    eps, free_chunk=free_chunk, lnc_split=lnc_split)
    return out, res_out


def simulate_add_layer_norm(x_np: np.ndarray, r_np: np.ndarray, w_np: np.ndarray,
                            b_np: np.ndarray, eps: float, *, lnc: int,
                            **tunables: Any) -> tuple[np.ndarray, np.ndarray]:
    """Run the kernel in AWS's CPU simulator, nki.simulate(kernel[lnc]), on float32 arrays."""
    out, res_out = KERNEL.simulate([x_np, r_np], [w_np, b_np], eps, lnc=lnc, **tunables)
    return out, res_out


def replay_add_layer_norm(
    x_np: np.ndarray, r_np: np.ndarray, w_np: np.ndarray, b_np: np.ndarray, eps: float, *,
    dtype: str, lnc: int, generation: str, **tunables: Any,
) -> tuple[np.ndarray, np.ndarray, nki_replay.Replay, Plan]:
    """Run the kernel's real body in the NumPy MODEL of NKI (nki_replay), not on hardware."""
    (out, res_out), result, plan = KERNEL.replay([x_np, r_np], [w_np, b_np], eps, dtype=dtype,
                                                 lnc=lnc, generation=generation, **tunables)
    return out, res_out, result, plan

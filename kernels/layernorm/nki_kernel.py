"""LayerNorm as an NKI kernel for Trainium: the torch op on `neuron`, the simulator, the CPU model.

y = (x - mean) * rsqrt(var + eps) * weight + bias over the last dim, var the biased (population)
variance, fp32 statistics, y in x.dtype. Written against Neuron SDK 2.33 (NKI 0.7.0,
torch-neuronx 2.14); signatures and sources as in kernels/rmsnorm/nki_kernel.py, plus
nisa.tensor_scalar(dst, data, op0, operand0, reverse0, op1, operand1, ...) whose operands must be
float32. Variance is two-pass on the resident tile, sum((x - mean)^2) via an activation whose
(P, 1) bias is -mean, which is exact where E[x^2] - mean^2 cancels. nki-library's own LayerNorm
(core/subkernels/layernorm_tkg.py) targets decode shapes; this kernel follows the RMSNorm recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from fusionlab.kernels import nki_replay
from fusionlab.kernels import nki_tiles as tiles
from fusionlab.kernels.layernorm import nki_tiling
from fusionlab.kernels.layernorm.nki_tiling import Plan
from fusionlab.kernels.nki_ops import TUNABLES, NkiKernel

__all__ = ["TUNABLES", "layer_norm_nki", "param_error", "replay_layer_norm", "simulate_layer_norm",
           "simulator_unavailable_reason", "unavailable_reason"]
NL_NAMES = ("ndarray", "sbuf", "shared_hbm", "float32", "program_id", "num_programs", "tile_size",
            "copy", "square", "rsqrt", "add", "multiply")
NISA_NAMES = ("dma_copy", "memset", "activation", "tensor_reduce", "tensor_scalar",
              "scalar_tensor_tensor", "reduce_cmd")

nl: Any = None
nisa: Any = None


def _layernorm_kernel(x: Any, w: Any, b: Any, eps: float, free_chunk: int, lnc_split: str,
                      resident: bool) -> Any:
    """out[r] = (x[r] - mean) * rsqrt(var + eps) * w[0] + b[0]; x [rows, hidden], w, b [1, H]."""
    out = tiles.hbm_like(nl, x)
    grid, (w_sb, b_sb), eps_sb = tiles.program_start(nl, nisa, x, free_chunk, lnc_split, eps, w, b)
    if grid.empty:
        return out
    parts, chunk = grid.parts, grid.chunk

    for rows in grid.tiles():
        n = rows[2]
        x_sb = tiles.resident_row(nl, grid, x.dtype) if resident else None

        # Pass 1: sum(x) per row -> -mean.
        load_x = partial(tiles.chunk_tile, nl, nisa, grid, x, rows, resident=x_sb)
        sums = tiles.row_sums(nl, nisa, grid, nl.copy, load_x, rows)
        neg_mean = tiles.neg_mean_tile(nl, nisa, grid, sums, n)

        # Pass 2: sum((x - mean)^2) per row -> rstd.
        reread_x = partial(tiles.chunk_tile, nl, nisa, grid, x, rows, resident=x_sb,
                           load=not resident)
        squares = tiles.row_sums(nl, nisa, grid, nl.square, reread_x, rows, bias=neg_mean[0:n, :])
        rstd = tiles.rstd_tile(nl, nisa, grid, squares, eps_sb, n)

        # Pass 3: y = ((x - mean) * w) * rstd + b, over the x chunk, then stored.
        for _, c0, c1 in grid.chunks():
            x_c = reread_x(c0, c1)
            centred = nl.ndarray((parts, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=centred[0:n, 0 : c1 - c0], data=x_c, op0=nl.add,
                                      operand0=neg_mean[0:n, :], op1=nl.multiply,
                                      operand1=w_sb[0:n, c0:c1])
            tiles.store_fused(nisa, out, rows, c0, c1, x_c, data=centred[0:n, 0 : c1 - c0],
                              op0=nl.multiply, operand0=rstd[0:n, :], op1=nl.add,
                              operand1=b_sb[0:n, c0:c1])
    return out




def _register_op(kernel: Callable[..., Any], lnc: int) -> Callable[..., torch.Tensor]:
    """`kernel`, launched at LNC degree `lnc`, as this module's torch op on `neuron`."""
    from torch_neuronx import nki_op

    @nki_op(f"fusionlab::layer_norm_nki_lnc{lnc}", mutates_args={})
    def layer_norm_nki_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                          free_chunk: int, lnc_split: str, resident: bool) -> torch.Tensor:
        return kernel(x, weight, bias, eps, free_chunk, lnc_split, resident)

    return layer_norm_nki_op


KERNEL = NkiKernel(_layernorm_kernel, globals(), nki_tiling.TILING, _register_op)
param_error = KERNEL.param_error
unavailable_reason = KERNEL.unavailable_reason
simulator_unavailable_reason = KERNEL.simulator_unavailable_reason


def layer_norm_nki(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *,
                   free_chunk: int, lnc_split: str) -> torch.Tensor:
    """LayerNorm over the last dim of `x` on the neuron device, eager, at the runtime's LNC degree
    (NkiKernel.on_device: non-contiguous rows are copied first, as part of the kernel's cost)."""
    (y,) = KERNEL.on_device([x], {"weight": weight, "bias": bias}, eps,
                            free_chunk=free_chunk, lnc_split=lnc_split)
    return y


def simulate_layer_norm(x_np: np.ndarray, w_np: np.ndarray, b_np: np.ndarray, eps: float, *,
                        lnc: int, **tunables: Any) -> np.ndarray:
    """Run the kernel in AWS's CPU simulator, nki.simulate(kernel[lnc]), on float32 arrays."""
    (y,) = KERNEL.simulate([x_np], [w_np, b_np], eps, lnc=lnc, **tunables)
    return y


def replay_layer_norm(x_np: np.ndarray, w_np: np.ndarray, b_np: np.ndarray, eps: float, *,
                      dtype: str, lnc: int, generation: str,
                      **tunables: Any) -> tuple[np.ndarray, nki_replay.Replay, Plan]:
    """Run the kernel's real body in the NumPy MODEL of NKI (nki_replay), not on hardware."""
    (y,), result, plan = KERNEL.replay([x_np], [w_np, b_np], eps, dtype=dtype, lnc=lnc,
                                       generation=generation, **tunables)
    return y, result, plan

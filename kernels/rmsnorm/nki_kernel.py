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

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from fusionlab.kernels import nki_replay
from fusionlab.kernels import nki_tiles as tiles
from fusionlab.kernels.nki_ops import TUNABLES, NkiKernel
from fusionlab.kernels.rmsnorm import nki_tiling
from fusionlab.kernels.rmsnorm.nki_tiling import Plan

__all__ = ["TUNABLES", "param_error", "replay_rms_norm", "rms_norm_nki", "simulate_rms_norm",
           "simulator_unavailable_reason", "unavailable_reason"]
# Exactly the nki.language / nki.isa names the kernel and the nki_tiles helpers it calls use: the
# availability check asks for these and the CPU model offers only these.
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
    out = tiles.hbm_like(nl, x)
    # Loaded once per program and kept: the weight row on every partition, and eps as a (P, 1)
    # bias tile, which every NeuronCore generation accepts.
    grid, (w_sb,), eps_sb = tiles.program_start(nl, nisa, x, free_chunk, lnc_split, eps, w)
    if grid.empty:
        return out

    for rows in grid.tiles():
        n = rows[2]
        x_sb = tiles.resident_row(nl, grid, x.dtype) if resident else None

        # Pass 1: each chunk's fp32 sum of squares lands in its own column, so chunks do not
        # wait on one another; a resident x chunk is loaded once and reused in pass 2.
        load_x = partial(tiles.chunk_tile, nl, nisa, grid, x, rows, resident=x_sb)
        squares = tiles.row_sums(nl, nisa, grid, nl.square, load_x, rows)
        rstd = tiles.rstd_tile(nl, nisa, grid, squares, eps_sb, n)

        # Pass 2: y = (x * rstd) * w, written over the x chunk it came from, then stored.
        for _, c0, c1 in grid.chunks():
            # The streamed plan reads x a second time (Plan.x_reads == 2).
            x_c = tiles.chunk_tile(nl, nisa, grid, x, rows, c0, c1, resident=x_sb,
                                   load=not resident)
            tiles.store_fused(nisa, out, rows, c0, c1, x_c, data=x_c, op0=nl.multiply,
                              operand0=rstd[0:n, :], op1=nl.multiply, operand1=w_sb[0:n, c0:c1])
    return out




def _register_op(kernel: Callable[..., Any], lnc: int) -> Callable[..., torch.Tensor]:
    """`kernel`, launched at LNC degree `lnc`, as this module's torch op on `neuron`."""
    from torch_neuronx import nki_op

    @nki_op(f"fusionlab::rms_norm_nki_lnc{lnc}", mutates_args={})
    def rms_norm_nki_op(x: torch.Tensor, weight: torch.Tensor, eps: float, free_chunk: int,
                        lnc_split: str, resident: bool) -> torch.Tensor:
        return kernel(x, weight, eps, free_chunk, lnc_split, resident)

    return rms_norm_nki_op


KERNEL = NkiKernel(_rmsnorm_kernel, globals(), nki_tiling.TILING, _register_op)
param_error = KERNEL.param_error
unavailable_reason = KERNEL.unavailable_reason
simulator_unavailable_reason = KERNEL.simulator_unavailable_reason


def rms_norm_nki(x: torch.Tensor, weight: torch.Tensor, eps: float, *, free_chunk: int,
                 lnc_split: str) -> torch.Tensor:
    """RMSNorm over the last dim of `x` on the neuron device, eager, at the runtime's LNC degree
    (NkiKernel.on_device: non-contiguous rows are copied first, as part of the kernel's cost)."""
    (y,) = KERNEL.on_device([x], {"weight": weight}, eps, free_chunk=free_chunk,
                            lnc_split=lnc_split)
    return y


def simulate_rms_norm(x_np: np.ndarray, w_np: np.ndarray, eps: float, *, lnc: int,
                      **tunables: Any) -> np.ndarray:
    """Run the kernel in AWS's CPU simulator, nki.simulate(kernel[lnc]), on float32 arrays."""
    (y,) = KERNEL.simulate([x_np], [w_np], eps, lnc=lnc, **tunables)
    return y


def replay_rms_norm(x_np: np.ndarray, w_np: np.ndarray, eps: float, *, dtype: str, lnc: int,
                    generation: str, **tunables: Any) -> tuple[np.ndarray, nki_replay.Replay, Plan]:
    """Run the kernel's real body in the NumPy MODEL of NKI (nki_replay), not on hardware."""
    (y,), result, plan = KERNEL.replay([x_np], [w_np], eps, dtype=dtype, lnc=lnc,
                                       generation=generation, **tunables)
    return y, result, plan

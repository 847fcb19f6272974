"""Triton RMSNorm: one [SPLIT, ROWS, CHUNK] tile of rows per program (kernels/common/
triton_tiles.py describes the launch space, kernels/common/triton_norms.py holds the row math)."""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels import norm_grads
from fusionlab.kernels.common import triton_tiles as tiles
from fusionlab.kernels.common.triton_tiles import TUNABLES, triton, unavailable_reason
from fusionlab.kernels.common.triton_tiles import tile_error as param_error
from fusionlab.kernels.triton_ops import fake_rows, save_inputs

__all__ = ["TUNABLES", "param_error", "rms_norm_triton", "unavailable_reason"]


if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_norms import rms_norm_tile
    from fusionlab.kernels.common.triton_tiles import load_rows, store_rows, tile_offsets

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_row_stride, y_row_stride, n_rows, n_cols, eps,
                         ROWS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        # x is read exactly once, so let it leave the cache first; w is reused by every program.
        x = load_rows(x_ptr, rows, x_row_stride, cols, mask)
        y = rms_norm_tile(x, w_ptr, cols, col_mask, n_cols, eps)
        store_rows(y_ptr, rows, y_row_stride, cols, y, mask)


@torch.library.custom_op("fusionlab::rms_norm_triton", mutates_args=())
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, block_size: int,
                    rows_per_program: int, threads_per_row: int) -> torch.Tensor:
    """RMSNorm over the last dim of `x`, scaled by `weight`; fp32 math, output in `x.dtype`."""
    tile = (block_size, rows_per_program, threads_per_row)
    x2d = tiles.checked_rows(x, tile, weight)
    y = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    tiles.launch_tiles(_rms_norm_kernel, x2d, (x2d, weight.contiguous(), y), (x2d, y), eps, tile)
    return y.view(x.shape)


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = norm_grads.rms_norm_grads(grad_y, x, weight, ctx.eps)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


rms_norm_triton.register_fake(fake_rows)
rms_norm_triton.register_autograd(_backward, setup_context=save_inputs)

"""Triton LayerNorm: y = (x - mean) * rsqrt(var + eps) * weight + bias, biased variance.

Same launch space as the RMSNorm kernel (fusionlab.kernels.common.triton_tiles: a
[SPLIT, ROWS, CHUNK] tile, `threads_per_row` threads per row, the row held in registers). The
variance is taken around the mean (as triton-lang/triton python/tutorials/05-layer-norm.py
`_layer_norm_fwd_fused` and linkedin/Liger-Kernel src/liger_kernel/ops/layer_norm.py do), never as
E[x^2] - E[x]^2, and from the row already in registers: two reductions, one read of x
(kernels/common/triton_norms.py `layer_norm_tile`).
"""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels import norm_grads
from fusionlab.kernels.common import triton_tiles as tiles
from fusionlab.kernels.common.triton_tiles import TUNABLES, triton, unavailable_reason
from fusionlab.kernels.common.triton_tiles import tile_error as param_error
from fusionlab.kernels.triton_ops import fake_rows, save_inputs

__all__ = ["TUNABLES", "layer_norm_triton", "param_error", "unavailable_reason"]

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_norms import layer_norm_tile
    from fusionlab.kernels.common.triton_tiles import load_rows, store_rows, tile_offsets

    @triton.jit
    def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, x_row_stride, y_row_stride, n_rows, n_cols,
                           eps, ROWS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        x = load_rows(x_ptr, rows, x_row_stride, cols, mask)
        y = layer_norm_tile(x, w_ptr, b_ptr, cols, col_mask, n_cols, eps)
        store_rows(y_ptr, rows, y_row_stride, cols, y, mask)


@torch.library.custom_op("fusionlab::layer_norm_triton", mutates_args=())
def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *,
                      block_size: int, rows_per_program: int, threads_per_row: int) -> torch.Tensor:
    """LayerNorm over the last dim of `x`; fp32 math, output in `x.dtype`."""
    tile = (block_size, rows_per_program, threads_per_row)
    x2d = tiles.checked_rows(x, tile, weight, bias)
    y = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    tiles.launch_tiles(_layer_norm_kernel, x2d, (x2d, weight.contiguous(), bias.contiguous(), y),
                 (x2d, y), eps, tile)
    return y.view(x.shape)


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = norm_grads.layer_norm_grads(grad_y, x, weight, ctx.eps)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None


layer_norm_triton.register_fake(fake_rows)
layer_norm_triton.register_autograd(_backward, setup_context=save_inputs)

"""Triton fused residual add + LayerNorm: residual_out = x + residual, out = layernorm(that).

x and residual are read once and both results written from the same registers; the sum is formed
in fp32 and stored in x.dtype, and the mean and variance are taken from the fp32 sum, around the
mean (never E[s^2] - E[s]^2), as kernels/layernorm/triton_kernel.py does for one input. Launch
space: fusionlab.kernels.common.triton_tiles. Checked in Triton's CPU interpreter only.
"""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels import norm_grads
from fusionlab.kernels.common.triton_tiles import (
    TUNABLES,
    checked_row_pair,
    launch_tiles,
    triton,
    unavailable_reason,
)
from fusionlab.kernels.common.triton_tiles import tile_error as param_error
from fusionlab.kernels.triton_ops import fake_row_pair, save_inputs

__all__ = ["TUNABLES", "add_layer_norm_triton", "param_error", "unavailable_reason"]

Pair = tuple[torch.Tensor, torch.Tensor]

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_norms import layer_norm_tile, residual_sum
    from fusionlab.kernels.common.triton_tiles import store_rows, tile_offsets

    @triton.jit
    def _add_layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, x_row_stride,
                               r_row_stride, y_row_stride, s_row_stride, n_rows, n_cols, eps,
                               ROWS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        s = residual_sum(x_ptr, r_ptr, s_ptr, rows, x_row_stride, r_row_stride, s_row_stride,
                         cols, mask)
        y = layer_norm_tile(s, w_ptr, b_ptr, cols, col_mask, n_cols, eps)
        store_rows(y_ptr, rows, y_row_stride, cols, y, mask)


@torch.library.custom_op("fusionlab::add_layer_norm_triton", mutates_args=())
def add_layer_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor, eps: float, *, block_size: int,
                          rows_per_program: int, threads_per_row: int) -> Pair:
    """(layernorm(x + residual) * weight + bias, x + residual), both in `x.dtype`."""
    tile = (block_size, rows_per_program, threads_per_row)
    x2d, r2d = checked_row_pair(x, residual, tile, weight, bias)
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    launch_tiles(_add_layer_norm_kernel, x2d,
                 (x2d, r2d, weight.contiguous(), bias.contiguous(), out, residual_out),
                 (x2d, r2d, out, residual_out), eps, tile)
    return out.view(x.shape), residual_out.view(x.shape)


def _backward(ctx: Any, grad_y: torch.Tensor | None,
              grad_residual_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    x, residual, weight, bias = ctx.saved_tensors
    grad_total, grad_weight, grad_bias = norm_grads.add_layer_norm_grads(
        grad_y, grad_residual_out, x, residual, weight, ctx.eps
    )
    return (grad_total.to(x.dtype), grad_total.to(residual.dtype), grad_weight.to(weight.dtype),
            grad_bias.to(bias.dtype), None)


add_layer_norm_triton.register_fake(fake_row_pair)
add_layer_norm_triton.register_autograd(_backward, setup_context=save_inputs)

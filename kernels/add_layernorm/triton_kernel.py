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
    as_rows,
    check_launch,
    num_warps_for,
    tile_constexprs,
    triton,
    unavailable_reason,
)
from fusionlab.kernels.common.triton_tiles import (
    tile_error as param_error,
)

__all__ = ["TUNABLES", "add_layer_norm_triton", "param_error", "unavailable_reason"]

Pair = tuple[torch.Tensor, torch.Tensor]

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_tiles import (
        load_columns,
        load_rows,
        row_sum,
        store_rows,
        tile_offsets,
    )

    @triton.jit
    def _add_layer_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        s_ptr,
        x_row_stride,
        r_row_stride,
        y_row_stride,
        s_row_stride,
        n_rows,
        n_cols,
        eps,
        ROWS: tl.constexpr,
        SPLIT: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        x = load_rows(x_ptr, rows, x_row_stride, cols, mask)
        r = load_rows(r_ptr, rows, r_row_stride, cols, mask)
        s = x + r
        store_rows(s_ptr, rows, s_row_stride, cols, s, mask)
        mean = row_sum(s) / n_cols
        # Padding columns must not add (0 - mean)^2 to the variance.
        sc = tl.where(col_mask, s - mean, 0.0)
        rstd = tl.rsqrt(row_sum(sc * sc) / n_cols + eps)
        w = load_columns(w_ptr, cols, col_mask)
        b = load_columns(b_ptr, cols, col_mask)
        y = sc * rstd * w + b
        store_rows(y_ptr, rows, y_row_stride, cols, y, mask)


@torch.library.custom_op("fusionlab::add_layer_norm_triton", mutates_args=())
def add_layer_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    block_size: int,
    rows_per_program: int,
    threads_per_row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layernorm(x + residual) * weight + bias, x + residual), both in `x.dtype`."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    error = param_error(tuple(x.shape), block_size, rows_per_program, threads_per_row)
    check_launch(x, error, weight, bias)
    x2d, r2d = as_rows(x), as_rows(residual)
    n_rows, hidden = x2d.shape
    out = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    residual_out = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    if n_rows > 0:
        _add_layer_norm_kernel[(triton.cdiv(n_rows, rows_per_program),)](
            x2d,
            r2d,
            weight.contiguous(),
            bias.contiguous(),
            out,
            residual_out,
            x2d.stride(0),
            r2d.stride(0),
            out.stride(0),
            residual_out.stride(0),
            n_rows,
            hidden,
            eps,
            **tile_constexprs(block_size, rows_per_program, threads_per_row, x.element_size()),
            num_warps=num_warps_for(rows_per_program, threads_per_row),
        )
    return out.view(x.shape), residual_out.view(x.shape)


@add_layer_norm_triton.register_fake
def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
          eps: float, *, block_size: int, rows_per_program: int, threads_per_row: int) -> Pair:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any],
                   output: Pair) -> None:
    x, residual, weight, bias, eps = inputs
    ctx.save_for_backward(x, residual, weight, bias)
    ctx.eps = eps


def _backward(ctx: Any, grad_y: torch.Tensor | None,
              grad_residual_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    x, residual, weight, bias = ctx.saved_tensors
    grad_total, grad_weight, grad_bias = norm_grads.add_layer_norm_grads(
        grad_y, grad_residual_out, x, residual, weight, ctx.eps
    )
    return (grad_total.to(x.dtype), grad_total.to(residual.dtype), grad_weight.to(weight.dtype),
            grad_bias.to(bias.dtype), None)


add_layer_norm_triton.register_autograd(_backward, setup_context=_setup_context)

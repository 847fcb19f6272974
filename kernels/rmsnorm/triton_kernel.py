"""Triton RMSNorm: one [SPLIT, ROWS, CHUNK] tile of rows per program (kernels/common/
triton_tiles.py describes the launch space)."""

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

__all__ = ["TUNABLES", "param_error", "rms_norm_triton", "unavailable_reason"]


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
    def _rms_norm_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        x_row_stride,
        y_row_stride,
        n_rows,
        n_cols,
        eps,
        ROWS: tl.constexpr,
        SPLIT: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        # x is read exactly once, so let it leave the cache first; w is reused by every program.
        x = load_rows(x_ptr, rows, x_row_stride, cols, mask)
        w = load_columns(w_ptr, cols, col_mask)
        rstd = tl.rsqrt(row_sum(x * x) / n_cols + eps)
        y = x * rstd * w
        store_rows(y_ptr, rows, y_row_stride, cols, y, mask)


@torch.library.custom_op("fusionlab::rms_norm_triton", mutates_args=())
def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    block_size: int,
    rows_per_program: int,
    threads_per_row: int,
) -> torch.Tensor:
    """RMSNorm over the last dim of `x`, scaled by `weight`; fp32 math, output in `x.dtype`."""
    error = param_error(tuple(x.shape), block_size, rows_per_program, threads_per_row)
    check_launch(x, error, weight)
    x2d = as_rows(x)
    n_rows, hidden = x2d.shape
    y = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return y.view(x.shape)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x2d,
        weight.contiguous(),
        y,
        x2d.stride(0),
        y.stride(0),
        n_rows,
        hidden,
        eps,
        **tile_constexprs(block_size, rows_per_program, threads_per_row, x.element_size()),
        num_warps=num_warps_for(rows_per_program, threads_per_row),
    )
    return y.view(x.shape)


@rms_norm_triton.register_fake
def _fake(x: torch.Tensor, weight: torch.Tensor, eps: float, *, block_size: int,
          rows_per_program: int, threads_per_row: int) -> torch.Tensor:
    return norm_grads.empty_like_rows(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any],
                   output: torch.Tensor) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = norm_grads.rms_norm_grads(grad_y, x, weight, ctx.eps)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


rms_norm_triton.register_autograd(_backward, setup_context=_setup_context)

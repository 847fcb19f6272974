"""The fused Triton backward of the Triton RMSNorm: `fusionlab::rms_norm_triton_backward` reads
each tile of rows once and writes dx and the tile's partial dweight (fp32, one row of partials per
program), which are then summed in a fixed order, Liger-Kernel's scheme (linkedin/Liger-Kernel
src/liger_kernel/ops/rms_norm.py `_rms_norm_backward_kernel`);
`fusionlab::rms_norm_triton_fused_grad` is the forward whose autograd calls it. Which backward
the `triton` variant uses is its `backward` tunable, swept only by the passes with a backward
(fusionlab/registry.py).

Verified only in Triton's CPU interpreter here (tests/test_triton_fused_backward.py); the tile
layout and launch are the forward's (kernels/common/triton_tiles.py)."""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels import norm_grads
from fusionlab.kernels.common.backward_choices import RECOMPUTING_CHOICES
from fusionlab.kernels.common.triton_backward import launch_backward
from fusionlab.kernels.common.triton_tiles import triton
from fusionlab.kernels.rmsnorm.triton_kernel import rms_norm_triton

BACKWARD_CHOICES = RECOMPUTING_CHOICES  # torch-ops, or this module's fused kernel


if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_backward import store_partial
    from fusionlab.kernels.common.triton_tiles import row_sum, tile_offsets

    @triton.jit
    def _rms_norm_backward_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        dx_ptr,
        dw_partial_ptr,
        dy_row_stride,
        x_row_stride,
        dx_row_stride,
        n_rows,
        n_cols,
        eps,
        ROWS: tl.constexpr,
        SPLIT: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(row_sum(x * x) / n_cols + eps)
        x_hat = x * rstd
        w_dy = w * dy
        # dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy)); masked lanes are 0 in x and dy.
        dx = (w_dy - x_hat * (row_sum(x_hat * w_dy) / n_cols)) * rstd
        tl.store(dx_ptr + rows * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        store_partial(dw_partial_ptr, dy * x_hat, n_cols, SPLIT, CHUNK)


@torch.library.custom_op("fusionlab::rms_norm_triton_backward", mutates_args=())
def rms_norm_triton_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    block_size: int,
    rows_per_program: int,
    threads_per_row: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's dtype) and dweight (weight's dtype) of RMSNorm, fp32 math, one read of each row."""
    dx, dweight = launch_backward(_rms_norm_backward_kernel, grad_y, x, (weight,), eps,
                                  block_size, rows_per_program, threads_per_row)
    return dx, dweight


@rms_norm_triton_backward.register_fake
def _fake_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   block_size: int, rows_per_program: int,
                   threads_per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_grads.empty_like_rows(x), torch.empty_like(weight)


@torch.library.custom_op("fusionlab::rms_norm_triton_fused_grad", mutates_args=())
def rms_norm_triton_fused_grad(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    block_size: int,
    rows_per_program: int,
    threads_per_row: int,
) -> torch.Tensor:
    """rms_norm_triton, its backward rms_norm_triton_backward."""
    return rms_norm_triton(x, weight, eps, block_size=block_size,
                           rows_per_program=rows_per_program, threads_per_row=threads_per_row)


@rms_norm_triton_fused_grad.register_fake
def _fake_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, *, block_size: int,
                  rows_per_program: int, threads_per_row: int) -> torch.Tensor:
    return norm_grads.empty_like_rows(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any],
                   output: torch.Tensor) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.tile = keyword_only_inputs


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = rms_norm_triton_backward(grad_y, x, weight, ctx.eps, **ctx.tile)
    return grad_x, grad_weight, None


rms_norm_triton_fused_grad.register_autograd(_backward, setup_context=_setup_context)

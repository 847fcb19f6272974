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

from fusionlab.kernels.common.backward_choices import RECOMPUTING_CHOICES
from fusionlab.kernels.common.triton_backward import launch_backward
from fusionlab.kernels.common.triton_tiles import triton
from fusionlab.kernels.rmsnorm.triton_kernel import rms_norm_triton
from fusionlab.kernels.triton_ops import fake_grads, fake_rows, save_inputs

BACKWARD_CHOICES = RECOMPUTING_CHOICES  # torch-ops, or this module's fused kernel


if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_backward import load_backward_tile, store_partial
    from fusionlab.kernels.common.triton_norms import rstd_of
    from fusionlab.kernels.common.triton_tiles import row_sum, store_rows

    @triton.jit
    def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_partial_ptr, dy_row_stride,
                                  x_row_stride, dx_row_stride, n_rows, n_cols, eps,
                                  ROWS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        rows, cols, _, mask, x, dy, w = load_backward_tile(
            dy_ptr, x_ptr, w_ptr, dy_row_stride, x_row_stride, n_rows, n_cols, ROWS, SPLIT, CHUNK)
        rstd = rstd_of(x, n_cols, eps)
        x_hat = x * rstd
        w_dy = w * dy
        # dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy)); masked lanes are 0 in x and dy.
        dx = (w_dy - x_hat * (row_sum(x_hat * w_dy) / n_cols)) * rstd
        store_rows(dx_ptr, rows, dx_row_stride, cols, dx, mask)
        store_partial(dw_partial_ptr, dy * x_hat, n_cols, SPLIT, CHUNK)


@torch.library.custom_op("fusionlab::rms_norm_triton_backward", mutates_args=())
def rms_norm_triton_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             eps: float, *, block_size: int, rows_per_program: int,
                             threads_per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's dtype) and dweight (weight's dtype) of RMSNorm, fp32 math, one read of each row."""
    dx, dweight = launch_backward(_rms_norm_backward_kernel, grad_y, x, (weight,), eps,
                                  block_size, rows_per_program, threads_per_row)
    return dx, dweight


@torch.library.custom_op("fusionlab::rms_norm_triton_fused_grad", mutates_args=())
def rms_norm_triton_fused_grad(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                               block_size: int, rows_per_program: int,
                               threads_per_row: int) -> torch.Tensor:
    """rms_norm_triton, its backward rms_norm_triton_backward."""
    return rms_norm_triton(x, weight, eps, block_size=block_size,
                           rows_per_program=rows_per_program, threads_per_row=threads_per_row)


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight = ctx.saved_tensors
    return (*rms_norm_triton_backward(grad_y, x, weight, ctx.eps, **ctx.tile), None)


rms_norm_triton_backward.register_fake(fake_grads)
rms_norm_triton_fused_grad.register_fake(fake_rows)
rms_norm_triton_fused_grad.register_autograd(_backward, setup_context=save_inputs)

"""The fused Triton backward of the Triton LayerNorm: `fusionlab::layer_norm_triton_backward`
reads each tile of rows once and writes dx and the tile's partial dweight and dbias (fp32, one row
of partials per program, summed in a fixed order afterwards: the RMSNorm kernel's scheme,
kernels/common/triton_backward.py); `fusionlab::layer_norm_triton_fused_grad` is the forward
whose autograd calls it. Verified only in Triton's CPU interpreter here
(tests/test_triton_fused_backward.py)."""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels.common.triton_backward import launch_backward
from fusionlab.kernels.common.triton_tiles import triton
from fusionlab.kernels.layernorm.triton_kernel import layer_norm_triton
from fusionlab.kernels.triton_ops import fake_grads, fake_rows, save_inputs

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_backward import load_backward_tile, store_partial
    from fusionlab.kernels.common.triton_norms import centred, rstd_of
    from fusionlab.kernels.common.triton_tiles import row_sum, store_rows

    @triton.jit
    def _layer_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, b_ptr, dx_ptr, dw_partial_ptr,
                                    db_partial_ptr, dy_row_stride, x_row_stride, dx_row_stride,
                                    n_rows, n_cols, eps, ROWS: tl.constexpr,
                                    SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        rows, cols, col_mask, mask, x, dy, w = load_backward_tile(
            dy_ptr, x_ptr, w_ptr, dy_row_stride, x_row_stride, n_rows, n_cols, ROWS, SPLIT, CHUNK)
        xc = centred(x, col_mask, n_cols)
        rstd = rstd_of(xc, n_cols, eps)
        x_hat = xc * rstd
        w_dy = w * dy
        # dx = rstd * (w*dy - mean(w*dy) - x_hat * mean(x_hat * w*dy)), padding lanes masked.
        dx = (w_dy - (row_sum(w_dy) + x_hat * row_sum(x_hat * w_dy)) / n_cols) * rstd
        store_rows(dx_ptr, rows, dx_row_stride, cols, dx, mask)
        store_partial(dw_partial_ptr, dy * x_hat, n_cols, SPLIT, CHUNK)
        store_partial(db_partial_ptr, dy, n_cols, SPLIT, CHUNK)


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("fusionlab::layer_norm_triton_backward", mutates_args=())
def layer_norm_triton_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor, eps: float, *, block_size: int,
                               rows_per_program: int, threads_per_row: int) -> Triple:
    """dx, dweight and dbias of LayerNorm in their inputs' dtypes, fp32 math, one read a row."""
    dx, dweight, dbias = launch_backward(_layer_norm_backward_kernel, grad_y, x, (weight, bias),
                                         eps, block_size, rows_per_program, threads_per_row)
    return dx, dweight, dbias


@torch.library.custom_op("fusionlab::layer_norm_triton_fused_grad", mutates_args=())
def layer_norm_triton_fused_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                 eps: float, *, block_size: int, rows_per_program: int,
                                 threads_per_row: int) -> torch.Tensor:
    """layer_norm_triton, its backward layer_norm_triton_backward."""
    return layer_norm_triton(x, weight, bias, eps, block_size=block_size,
                             rows_per_program=rows_per_program, threads_per_row=threads_per_row)


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, bias = ctx.saved_tensors
    return (*layer_norm_triton_backward(grad_y, x, weight, bias, ctx.eps, **ctx.tile), None)


layer_norm_triton_backward.register_fake(fake_grads)
layer_norm_triton_fused_grad.register_fake(fake_rows)
layer_norm_triton_fused_grad.register_autograd(_backward, setup_context=save_inputs)

"""Triton fused residual add + RMSNorm: residual_out = x + residual, out = rmsnorm(residual_out).

x and residual are read once and both results written from the same registers; the sum is formed
in fp32, stored in x.dtype, and the norm is taken from the fp32 sum (vLLM's fused_add_rms_norm,
vllm-project/vllm csrc/layernorm_kernels.cu; Liger's fused add in linkedin/Liger-Kernel
src/liger_kernel/ops/fused_add_rms_norm.py). Launch space: fusionlab.kernels.common.triton_tiles.
"""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels import norm_grads
from fusionlab.kernels.common.triton_tiles import (
    TUNABLES,
    Tile,
    checked_row_pair,
    launch_tiles,
    triton,
    unavailable_reason,
)
from fusionlab.kernels.common.triton_tiles import tile_error as param_error
from fusionlab.kernels.triton_ops import fake_row_pair, save_inputs

__all__ = [
    "TUNABLES",
    "add_rms_norm_triton",
    "add_rms_norm_triton_",
    "param_error",
    "unavailable_reason",
]

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_norms import residual_sum, rms_norm_tile
    from fusionlab.kernels.common.triton_tiles import store_rows, tile_offsets

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, x_row_stride, r_row_stride,
                             y_row_stride, s_row_stride, n_rows, n_cols, eps,
                             ROWS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        s = residual_sum(x_ptr, r_ptr, s_ptr, rows, x_row_stride, r_row_stride, s_row_stride,
                         cols, mask)
        y = rms_norm_tile(s, w_ptr, cols, col_mask, n_cols, eps)
        store_rows(y_ptr, rows, y_row_stride, cols, y, mask)


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor, tile: Tile) -> None:
    launch_tiles(_add_rms_norm_kernel, x, (x, residual, weight.contiguous(), out, residual_out),
                 (x, residual, out, residual_out), eps, tile)


@torch.library.custom_op("fusionlab::add_rms_norm_triton", mutates_args=())
def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        *, block_size: int, rows_per_program: int,
                        threads_per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual), both in `x.dtype`; inputs untouched."""
    tile = (block_size, rows_per_program, threads_per_row)
    x2d, r2d = checked_row_pair(x, residual, tile, weight)
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    _launch(x2d, r2d, weight, eps, out, residual_out, tile)
    return out.view(x.shape), residual_out.view(x.shape)


@torch.library.custom_op("fusionlab::add_rms_norm_triton_", mutates_args=("x", "residual"))
def _add_rms_norm_triton_inplace(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float, *, block_size: int, rows_per_program: int,
                                 threads_per_row: int) -> None:
    """The in-place op; it returns nothing, since torch.compile cannot functionalize a custom
    op whose outputs alias its inputs."""
    tile = (block_size, rows_per_program, threads_per_row)
    x2d, r2d = checked_row_pair(x, residual, tile, weight)
    _launch(x2d, r2d, weight, eps, x2d, r2d, tile)
    # as_rows copies when the strides admit no [rows, hidden] view; write those results back.
    for target, result in ((x, x2d), (residual, r2d)):
        if result.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
            target.copy_(result.view(target.shape))


@_add_rms_norm_triton_inplace.register_fake
def _fake_inplace(x: torch.Tensor, *args: Any, **tunables: Any) -> None:
    return None


def add_rms_norm_triton_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float, *, block_size: int, rows_per_program: int,
                         threads_per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In place (vLLM style): x becomes the normed output, residual becomes x + residual."""
    _add_rms_norm_triton_inplace(x, residual, weight, eps, block_size=block_size,
                                 rows_per_program=rows_per_program,
                                 threads_per_row=threads_per_row)
    return x, residual


def _backward(ctx: Any, grad_y: torch.Tensor | None,
              grad_residual_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    x, residual, weight = ctx.saved_tensors
    grad_total, grad_weight = norm_grads.add_rms_norm_grads(
        grad_y, grad_residual_out, x, residual, weight, ctx.eps
    )
    return grad_total.to(x.dtype), grad_total.to(residual.dtype), grad_weight.to(weight.dtype), None


add_rms_norm_triton.register_fake(fake_row_pair)
add_rms_norm_triton.register_autograd(_backward, setup_context=save_inputs)

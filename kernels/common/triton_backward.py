"""What the fused Triton backwards share: each program reads its tile of dy, x and the weight
(load_backward_tile), writes its rows' partial sums of a vector's gradient (store_partial), and
launch_backward runs a backward kernel over the forward's tile and sums those partials in a fixed
order, Liger-Kernel's scheme (linkedin/Liger-Kernel src/liger_kernel/ops/rms_norm.py
`_rms_norm_backward_kernel`)."""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels.common.triton_tiles import as_rows, checked_rows, launch_tiles, triton

if triton is not None:
    import triton.language as tl

    from fusionlab.kernels.common.triton_tiles import tile_offsets

    @triton.jit
    def load_backward_tile(dy_ptr, x_ptr, w_ptr, dy_row_stride, x_row_stride, n_rows, n_cols,
                           ROWS: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        """This program's tile (rows, cols, col_mask, mask) and its x, dy and weight as fp32;
        masked lanes are 0."""
        rows, cols, col_mask, mask = tile_offsets(n_rows, n_cols, ROWS, SPLIT, CHUNK)
        x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        return rows, cols, col_mask, mask, x, dy, w

    @triton.jit
    def store_partial(partial_ptr, v, n_cols, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
        """This program's rows of a [SPLIT, ROWS, CHUNK] tile summed into its row of partials."""
        cols = tl.arange(0, SPLIT)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols, tl.sum(v, axis=1),
                 mask=cols < n_cols)


def launch_backward(kernel: Any, grad_y: torch.Tensor, x: torch.Tensor,
                    vectors: tuple[torch.Tensor, ...], eps: float, block_size: int,
                    rows_per_program: int, threads_per_row: int) -> tuple[torch.Tensor, ...]:
    """Run a fused backward kernel taking (dy, x, *vectors, dx, one partials buffer per vector,
    strides, n_rows, n_cols, eps, tile): dx, then each vector's gradient summed over the
    programs' partials in a fixed order."""
    tile = (block_size, rows_per_program, threads_per_row)
    x2d = checked_rows(x, tile, *vectors)
    dy2d = as_rows(grad_y)
    n_rows, hidden = x2d.shape
    dx = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    programs = triton.cdiv(n_rows, rows_per_program)
    partials = [torch.zeros((programs, hidden), dtype=torch.float32, device=x.device)
                for _ in vectors]
    launch_tiles(kernel, x2d, (dy2d, x2d, *(v.contiguous() for v in vectors), dx, *partials),
                 (dy2d, x2d, dx), eps, tile)
    return dx.view(x.shape), *(p.sum(0).to(v.dtype) for p, v in zip(partials, vectors,
                                                                     strict=True))

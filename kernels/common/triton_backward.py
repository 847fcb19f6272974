"""What the fused Triton backwards share: each program writes its rows' partial sums of a
vector's gradient (store_partial), and launch_backward runs a backward kernel over the forward's
tile and sums those partials in a fixed order, Liger-Kernel's scheme (linkedin/Liger-Kernel
src/liger_kernel/ops/rms_norm.py `_rms_norm_backward_kernel`)."""

from __future__ import annotations

from typing import Any

import torch

from fusionlab.kernels.common.triton_tiles import (
    as_rows,
    check_launch,
    num_warps_for,
    tile_constexprs,
    tile_error,
    triton,
)

if triton is not None:
    import triton.language as tl

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
    check_launch(x, tile_error(tuple(x.shape), block_size, rows_per_program, threads_per_row),
                 *vectors)
    x2d, dy2d = as_rows(x), as_rows(grad_y)
    n_rows, hidden = x2d.shape
    dx = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    programs = triton.cdiv(n_rows, rows_per_program)
    partials = [torch.zeros((programs, hidden), dtype=torch.float32, device=x.device)
                for _ in vectors]
    if n_rows:
        kernel[(programs,)](
            dy2d, x2d, *(v.contiguous() for v in vectors), dx, *partials,
            dy2d.stride(0), x2d.stride(0), dx.stride(0), n_rows, hidden, eps,
            **tile_constexprs(block_size, rows_per_program, threads_per_row, x.element_size()),
            num_warps=num_warps_for(rows_per_program, threads_per_row),
        )
    return dx.view(x.shape), *(p.sum(0).to(v.dtype) for p, v in zip(partials, vectors,
                                                                     strict=True))

"""Triton RMSNorm kernels: one row per program, or several short rows per program."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    triton = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

# Triton picks the interpreter when a kernel is decorated, so the import-time value is what counts.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes"}

TUNABLES: dict[str, tuple[int, ...]] = {
    "block_size": tuple(2**i for i in range(16)),  # 1 .. 32768
    "rows_per_program": (1, 2, 4, 8, 16),
    "num_warps": (1, 2, 4, 8, 16),
}

# Longer rows already give a program enough memory traffic; packing more only coarsens the grid.
_MAX_PACKED_BLOCK = 1024
# Beyond this many fp32 values per thread the row no longer fits in registers and spills.
_MAX_ELEMENTS_PER_THREAD = 64


if triton is not None:

    @triton.jit
    def _rms_norm_row_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        x_row_stride,
        y_row_stride,
        n_cols,
        eps,
        BLOCK_SIZE: tl.constexpr,
    ):
        # int64 row offsets: rows * stride can exceed 2**31 for large activations.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        # x is read exactly once, so let it leave the cache first; w is reused by every program.
        x = tl.load(
            x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first"
        ).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        y = x * rstd * w
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_rows_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        x_row_stride,
        y_row_stride,
        n_rows,
        n_cols,
        eps,
        BLOCK_SIZE: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        cols = tl.arange(0, BLOCK_SIZE)
        col_mask = cols < n_cols
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        x = tl.load(
            x_ptr + rows[:, None] * x_row_stride + cols[None, :],
            mask=mask,
            other=0.0,
            eviction_policy="evict_first",
        ).to(tl.float32)
        # One weight load per program, broadcast over all of its rows.
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(
            tl.float32
        )
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        y = x * rstd[:, None] * w[None, :]
        tl.store(
            y_ptr + rows[:, None] * y_row_stride + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask,
        )


def unavailable_reason(device_type: str) -> str | None:
    """Why the Triton kernels cannot run on `device_type` tensors here, or None if they can."""
    if _IMPORT_ERROR is not None:
        if getattr(_IMPORT_ERROR, "name", None) == "triton":
            return "triton is not installed (pip install 'fusionlab[triton]')"
        return f"triton failed to import: {_IMPORT_ERROR}"
    if _INTERPRET:
        return None
    if device_type != "cuda":
        return (
            f"Triton kernels need a CUDA device, not {device_type!r} "
            "(set TRITON_INTERPRET=1 before importing to run them on CPU for testing)"
        )
    if not torch.cuda.is_available():
        return "Triton kernels need a CUDA device, but torch.cuda.is_available() is False"
    return None


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def param_error(hidden: int, block_size: int, rows_per_program: int, num_warps: int) -> str | None:
    """Why this tunable combination cannot (or should not) run for rows of `hidden`, else None."""
    if hidden < 1:
        return f"hidden must be positive, got {hidden}"
    for name, value in (
        ("block_size", block_size),
        ("rows_per_program", rows_per_program),
        ("num_warps", num_warps),
    ):
        if not _is_power_of_two(value):
            return f"{name} must be a positive power of two, got {value}"
    if block_size < hidden:
        return f"block_size {block_size} < hidden {hidden}: the row must fit in one block"
    if block_size >= 2 * hidden:
        # The row is held whole, so a bigger block only adds masked lanes and registers.
        return f"block_size {block_size} wastes lanes: hidden {hidden} needs {_next_pow2(hidden)}"
    if rows_per_program > 1 and block_size > _MAX_PACKED_BLOCK:
        return (
            f"rows_per_program > 1 is for short rows (block_size <= {_MAX_PACKED_BLOCK}), "
            f"got block_size {block_size}"
        )
    tile = block_size * rows_per_program
    threads = 32 * num_warps
    if num_warps > 1 and tile < threads:
        return f"num_warps {num_warps} leaves threads idle: {tile} elements for {threads} threads"
    if tile > _MAX_ELEMENTS_PER_THREAD * threads:
        return (
            f"num_warps {num_warps} is too few for {tile} elements per program "
            f"(> {_MAX_ELEMENTS_PER_THREAD} per thread would spill registers)"
        )
    return None


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    block_size: int,
    rows_per_program: int,
    num_warps: int,
) -> torch.Tensor:
    """RMSNorm over the last dim of `x`, scaled by `weight`; fp32 math, output in `x.dtype`."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    error = param_error(hidden, block_size, rows_per_program, num_warps)
    if error is not None:
        raise ValueError(error)
    reason = unavailable_reason(x.device.type)
    if reason is not None:
        raise RuntimeError(reason)

    x2d = x.reshape(-1, hidden)  # a view whenever the leading dims collapse to one row stride
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    weight = weight.contiguous()
    n_rows = x2d.shape[0]
    y = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return y.view(x.shape)

    if rows_per_program == 1:
        _rms_norm_row_kernel[(n_rows,)](
            x2d,
            weight,
            y,
            x2d.stride(0),
            y.stride(0),
            hidden,
            eps,
            BLOCK_SIZE=block_size,
            num_warps=num_warps,
        )
    else:
        _rms_norm_rows_kernel[(triton.cdiv(n_rows, rows_per_program),)](
            x2d,
            weight,
            y,
            x2d.stride(0),
            y.stride(0),
            n_rows,
            hidden,
            eps,
            BLOCK_SIZE=block_size,
            ROWS_PER_PROGRAM=rows_per_program,
            num_warps=num_warps,
        )
    return y.view(x.shape)

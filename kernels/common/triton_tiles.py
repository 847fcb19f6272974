"""The Triton launch space the norm kernels share: tunables, tile checks and the tile helpers.

A program normalises `rows_per_program` rows with `threads_per_row` threads each (Quack's
`threads_per_row`/`num_threads` pair, Dao-AILab/quack quack/rmsnorm_config.py `_for_hopper_fwd`:
hidden 4096 -> 64 threads per row, 2 rows per 128-thread CTA). The whole row is held in registers:
the tile is [SPLIT, ROWS, CHUNK] with CHUNK = threads_per_row * vector contiguous columns, so
Triton's blocked layout (filled along its order [2, 1, 0]: columns, then rows) puts exactly
`threads_per_row` threads on a row and the warps left over on further rows, and each thread keeps
SPLIT vectors of its row; `tests/test_triton_hopper.py` checks that layout in the compiled TTGIR.
One row per program with 4-32 warps is Liger's setting (linkedin/Liger-Kernel
src/liger_kernel/ops/utils.py `calculate_settings`: 8 warps at 4096, 16 at 8192);
triton-lang/triton python/tutorials/05-layer-norm.py instead walks the row in BLOCK_SIZE chunks,
re-reading it once per pass, which this space leaves out (rows here are read once).

Per-thread cost: a thread holds block_size / threads_per_row fp32 values of its row, about two
registers each. ptxas for sm_90 keeps 64 of them in ~127 registers without a spill (the old
"spills at 64" rationale was wrong): what more values cost is registers per thread, hence fewer
resident warps per SM (65536 registers per SM; 127 registers leave 16 of 64 warps), which is the
trade the sweep measures. Spills do appear when one block asks for more than the SM's 65536
registers (16 rows x 4096 in bf16: ptxas caps 1024 threads at 64 registers and spills ~1 KB;
8 rows x 4096 in fp32: 512 threads capped at 128 registers spill 56 B), so param_error rejects
tiles of more than 16384 values (3 registers per value, the fp32 worst case, within 65536).
Every accepted point at hidden 4096 and 8192, bf16 and fp32, is compiled and asserted spill-free
by tests/test_triton_hopper.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

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
    # 1 .. 16384: the row padded to a power of two; longer rows exceed an SM's registers (below).
    "block_size": tuple(2**i for i in range(15)),
    "rows_per_program": (1, 2, 4, 8, 16, 32, 64),
    "threads_per_row": tuple(2**i for i in range(11)),  # 1 .. 1024
}

_WARP = 32
_MAX_THREADS = 1024  # per CUDA block, so num_warps <= 32
# fp32 values of a row per thread that every op here compiles to with zero spills on sm_90
# (ptxas -v: 64 values take 116-127 registers of the 255 a thread may have).
_MAX_ELEMENTS_PER_THREAD = 64
# Registers per held value, measured by ptxas for sm_90: ~2 for bf16 (64 values -> 116-127),
# ~2.5 for fp32 (64 -> 161-164, 32 -> 78-90). param_error knows no dtype, so it budgets 3.
_REGISTERS_PER_VALUE = 3
_SM_REGISTERS = 65536
_VECTOR_BYTES = 16  # the widest global load/store (ld.global.v4.b32)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def num_warps_for(rows_per_program: int, threads_per_row: int) -> int:
    """Warps per program: one thread per (row, thread-of-row) pair, at least one warp."""
    return max(1, rows_per_program * threads_per_row // _WARP)


def tile_error(
    shape: tuple[int, ...], block_size: int, rows_per_program: int, threads_per_row: int
) -> str | None:
    """Why this tile cannot (or should not) run on inputs of `shape`, else None."""
    if not shape or shape[-1] < 1:
        return f"the last dim must be positive, got shape {tuple(shape)}"
    hidden = shape[-1]
    n_rows = math.prod(shape[:-1])
    for name, value in (
        ("block_size", block_size),
        ("rows_per_program", rows_per_program),
        ("threads_per_row", threads_per_row),
    ):
        if not _is_power_of_two(value):
            return f"{name} must be a positive power of two, got {value}"
    if block_size != _next_pow2(hidden):
        # The row is held whole; a bigger block only adds masked lanes and registers.
        return f"block_size {block_size} != {_next_pow2(hidden)}, the next power of two of {hidden}"
    if threads_per_row > block_size:
        return f"threads_per_row {threads_per_row} > block_size {block_size}: idle threads"
    per_thread = block_size // threads_per_row
    if per_thread > _MAX_ELEMENTS_PER_THREAD:
        return (
            f"{per_thread} values per thread (> {_MAX_ELEMENTS_PER_THREAD}) spill registers "
            f"on sm_90; use threads_per_row >= {block_size // _MAX_ELEMENTS_PER_THREAD}"
        )
    threads = rows_per_program * threads_per_row
    if threads > _MAX_THREADS:
        return f"{threads} threads per program exceed CUDA's {_MAX_THREADS}"
    if rows_per_program * block_size * _REGISTERS_PER_VALUE > _SM_REGISTERS:
        # A block's threads share one SM's register file, so each gets at most 65536 / threads.
        return (
            f"a {rows_per_program} x {block_size} tile needs up to "
            f"{rows_per_program * block_size * _REGISTERS_PER_VALUE} registers (fp32), more than "
            f"the {_SM_REGISTERS} of an SM: it spills"
        )
    if rows_per_program > _next_pow2(max(n_rows, 1)):
        return f"rows_per_program {rows_per_program} > {n_rows} rows: the extra rows are masked"
    if threads < _WARP and (threads_per_row < block_size or rows_per_program < n_rows):
        # Lanes of the one warp would idle although more columns or rows could fill them.
        return (
            f"{threads} threads per program leave a warp part-idle; "
            "raise threads_per_row or rows_per_program"
        )
    return None


def tile_constexprs(
    block_size: int, rows_per_program: int, threads_per_row: int, element_size: int
) -> dict[str, int]:
    """The kernel's constexprs: SPLIT x ROWS x CHUNK tile, CHUNK = threads x vector columns."""
    vector = min(_VECTOR_BYTES // element_size, block_size // threads_per_row)
    chunk = threads_per_row * vector
    return {"ROWS": rows_per_program, "SPLIT": block_size // chunk, "CHUNK": chunk}


def unavailable_reason(device_type: str = "cuda") -> str | None:
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


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as [rows, hidden] with unit column stride: a view when strides allow, else a copy."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(1) == 1 or t2d.shape[1] == 1 else t2d.contiguous()


def check_launch(x: torch.Tensor, error: str | None, *vectors: torch.Tensor) -> None:
    """Raise ValueError for a bad tile or parameter vector, RuntimeError without a toolchain."""
    if error is not None:
        raise ValueError(error)
    for vec in vectors:
        if vec.shape != (x.shape[-1],):
            raise ValueError(f"parameter shape {tuple(vec.shape)} != ({x.shape[-1]},)")
    reason = unavailable_reason(x.device.type)
    if reason is not None:
        raise RuntimeError(reason)


Tile = tuple[int, int, int]  # (block_size, rows_per_program, threads_per_row)


def checked_rows(x: torch.Tensor, tile: Tile, *vectors: torch.Tensor) -> torch.Tensor:
    """`x` as [rows, hidden] (as_rows) once `tile` and the parameter vectors are checked for it."""
    check_launch(x, tile_error(tuple(x.shape), *tile), *vectors)
    return as_rows(x)


def checked_row_pair(x: torch.Tensor, residual: torch.Tensor, tile: Tile,
                     *vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and residual as [rows, hidden] once their shapes, `tile` and the vectors are checked."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    return checked_rows(x, tile, *vectors), as_rows(residual)


def launch_tiles(kernel: Any, x2d: torch.Tensor, pointers: Sequence[torch.Tensor],
                 strided: Sequence[torch.Tensor], eps: float, tile: Tile) -> None:
    """Run a norm kernel over x2d's rows, one tile per program. Its arguments: `pointers`, the
    row strides of `strided`, n_rows, n_cols, eps, then the tile's constexprs."""
    n_rows, hidden = x2d.shape
    if n_rows == 0:
        return
    block_size, rows_per_program, threads_per_row = tile
    kernel[(triton.cdiv(n_rows, rows_per_program),)](
        *pointers, *(t.stride(0) for t in strided), n_rows, hidden, eps,
        **tile_constexprs(block_size, rows_per_program, threads_per_row, x2d.element_size()),
        num_warps=num_warps_for(rows_per_program, threads_per_row),
    )


if triton is not None:

    @triton.jit
    def tile_offsets(
        n_rows,
        n_cols,
        ROWS: tl.constexpr,
        SPLIT: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """This program's rows ([1, ROWS, 1], int64), column offsets and masks of its tile."""
        # int64 rows: rows * stride can exceed 2**31 for large activations.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[None, :, None]
        cols = tl.arange(0, SPLIT)[:, None, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
        # Broadcast to the full tile so parameter vectors load in x's layout (per-thread copies,
        # as Quack does) instead of one load converted through shared memory.
        cols = tl.broadcast_to(cols, (SPLIT, ROWS, CHUNK))
        col_mask = cols < n_cols
        return rows, cols, col_mask, col_mask & (rows < n_rows)

    @triton.jit
    def row_sum(v):
        """Sum of a [SPLIT, ROWS, CHUNK] tile per row, kept as [1, ROWS, 1]."""
        # The in-thread SPLIT axis first, so only one value per thread enters the shuffles.
        return tl.sum(tl.sum(v, axis=0), axis=1)[None, :, None]

    @triton.jit
    def load_rows(ptr, rows, row_stride, cols, mask):
        """A tile of rows as fp32, read exactly once: it may leave the cache first."""
        return tl.load(
            ptr + rows * row_stride + cols, mask=mask, other=0.0, eviction_policy="evict_first"
        ).to(tl.float32)

    @triton.jit
    def load_columns(ptr, cols, col_mask):
        """A per-column vector (weight, bias) as fp32, kept in cache: every program reuses it."""
        return tl.load(ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(
            tl.float32
        )

    @triton.jit
    def store_rows(ptr, rows, row_stride, cols, v, mask):
        """A tile of rows written in the element type of `ptr`."""
        tl.store(ptr + rows * row_stride + cols, v.to(ptr.dtype.element_ty), mask=mask)

"""The `store`, `stats` and `row_group` tunables of the C++ CPU kernels.

`store`: plain stores, or non-temporal ("stream") stores that skip reading each output line before
writing it. Which is faster depends on the output's size and on whether its pages are already
mapped, so the sweep measures both per cell.

"auto" (the ops' default when no tunable is given) streams outputs of 8 MiB or more; every choice
falls back to plain stores where streaming cannot apply (rows not 64-byte aligned, output pages
not yet mapped, a scalar build), as the C++ StoreKind in rmsnorm/csrc/cpu_norm_common.h does.

`stats` (LayerNorm kernels): the row's mean and variance by Welford's update, or by shifted fp32
sums (fewer operations per element; layernorm/csrc/welford_moments.h says when they lose accuracy,
and the float64 gate judges each cell). `row_group`: rows normalised together, sharing each load
of the weight and bias (1, or 4 where x has at least 4 rows; a task's leftover rows go one by one).

`passes` (RMSNorm kernels): "two" reads each row for its statistics and again from L1/L2 for the
normalised write; "one" widens it once into an fp32 row buffer that both steps read (a bf16 or
fp16 element is converted once), offered where that buffer fits in L2. Bit for bit the same.
`task_bytes`: the least bytes of x a parallel task covers (0: rows_per_task alone sets the grain);
short rows then wake no more threads than their bytes are worth.
"""

from __future__ import annotations

import math

from fusionlab.kernels import cpp_build

STORE_CHOICES: tuple[str, ...] = ("plain", "stream")
STREAM_MIN_ELEMENTS = 1 << 18
"""Outputs smaller than this (1 MiB in fp32) are not offered "stream": they stay in cache."""
STATS_CHOICES: tuple[str, ...] = ("welford", "shifted")
ROW_GROUP_CHOICES: tuple[int, ...] = (1, 4)
PASSES_CHOICES: tuple[str, ...] = ("two", "one")
ONE_PASS_MAX_ELEMENTS = 1 << 16
"""Rows wider than this (a 256 KiB fp32 buffer) would not stay in L2: "one" is not offered."""
TASK_BYTES_CHOICES: tuple[int, ...] = (0, 1 << 16)
_ROW_ALIGN_ELEMENTS = 32  # 64 bytes of bf16/fp16; of fp32, two cache lines


def store_error(shape: tuple[int, ...], store: str) -> str | None:
    """Why `store` cannot take effect at this shape, or None (see the module docstring)."""
    if store not in (*STORE_CHOICES, "auto"):
        return f"store must be one of auto, {', '.join(STORE_CHOICES)}; got {store!r}"
    if store != "stream":
        return None
    if cpp_build.vector_isa() == "DEFAULT":
        return "stream needs a vector build (this one is scalar)"
    if math.prod(shape) < STREAM_MIN_ELEMENTS:
        return f"stream is offered from {STREAM_MIN_ELEMENTS} elements; smaller outputs stay cached"
    if shape[-1] % _ROW_ALIGN_ELEMENTS:
        return f"stream needs rows of a multiple of {_ROW_ALIGN_ELEMENTS} elements"
    return None


def layout_error(shape: tuple[int, ...], stats: str, row_group: int) -> str | None:
    """Why `stats` or `row_group` cannot run at this shape, or None."""
    if stats not in STATS_CHOICES:
        return f"stats must be one of {', '.join(STATS_CHOICES)}; got {stats!r}"
    if row_group not in ROW_GROUP_CHOICES:
        return f"row_group must be one of {', '.join(map(str, ROW_GROUP_CHOICES))}; got {row_group}"
    if row_group > 1 and math.prod(shape[:-1]) < row_group:
        return f"row_group {row_group} needs at least {row_group} rows"
    return None


def path_error(shape: tuple[int, ...], passes: str, task_bytes: int) -> str | None:
    """Why `passes` or `task_bytes` cannot run at this shape, or None."""
    if passes not in PASSES_CHOICES:
        return f"passes must be one of {', '.join(PASSES_CHOICES)}; got {passes!r}"
    if task_bytes < 0:
        return f"task_bytes must be >= 0, got {task_bytes}"
    if passes == "one" and shape[-1] > ONE_PASS_MAX_ELEMENTS:
        return f"passes one is offered for rows of up to {ONE_PASS_MAX_ELEMENTS} elements"
    return None

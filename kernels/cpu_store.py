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
"""

from __future__ import annotations

import math

from fusionlab.kernels import cpp_build

STORE_CHOICES: tuple[str, ...] = ("plain", "stream")
STREAM_MIN_ELEMENTS = 1 << 18
"""Outputs smaller than this (1 MiB in fp32) are not offered "stream": they stay in cache."""
STATS_CHOICES: tuple[str, ...] = ("welford", "shifted")
ROW_GROUP_CHOICES: tuple[int, ...] = (1, 4)
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

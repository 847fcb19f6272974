"""The `store` tunable of the C++ CPU kernels: plain stores, or non-temporal ("stream") stores that
skip reading each output line before writing it. Which is faster depends on the output's size
and on whether its pages are already mapped, so the sweep measures both per cell.

"auto" (the ops' default when no tunable is given) streams outputs of 8 MiB or more; every choice
falls back to plain stores where streaming cannot apply (rows not 64-byte aligned, output pages
not yet mapped, a scalar build), as the C++ StoreKind in rmsnorm/csrc/cpu_norm_common.h does.
"""

from __future__ import annotations

import math

from fusionlab.kernels import cpp_build

STORE_CHOICES: tuple[str, ...] = ("plain", "stream")
STREAM_MIN_ELEMENTS = 1 << 18
"""Outputs smaller than this (1 MiB in fp32) are not offered "stream": they stay in cache."""
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

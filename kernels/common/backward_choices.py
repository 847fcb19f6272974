"""The `backward` tunable's values: torch-ops, kernels/norm_grads.py's backward; fused, an op's
fused kernel with the row statistics recomputed from x; fused-saved, the fused kernel reading the
statistics the forward saved (fp32, one per row: more memory kept for backward, less arithmetic
in it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

RECOMPUTING_CHOICES: tuple[str, ...] = ("torch-ops", "fused")
"""The backwards every op with a fused kernel has."""
SAVING_CHOICES: tuple[str, ...] = (*RECOMPUTING_CHOICES, "fused-saved")
"""Those of an op whose forward can also save its row statistics."""


def check_backward(backward: str, choices: tuple[str, ...]) -> None:
    """Refuse a `backward` that is none of `choices`."""
    if backward not in choices:
        raise ValueError(f"backward must be one of {', '.join(choices)}, got {backward!r}")


def fused_backward(backward: str, kernels: Mapping[str, Callable[..., Any]],
                   load: Callable[[], object] | None = None) -> Callable[..., Any] | None:
    """The fused kernel of `kernels` (backward name -> kernel) chosen by `backward`, after
    `load()` (its extension built or loaded); None for torch-ops (the forward kernel as it is).
    A `backward` that is neither is refused."""
    check_backward(backward, ("torch-ops", *kernels))
    if backward == "torch-ops":
        return None
    if load is not None:
        load()
    return kernels[backward]

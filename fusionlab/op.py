"""The op spec: what defines an operation independently of any lowering."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Inputs = tuple[object, ...]


@dataclass(frozen=True)
class Tolerance:
    """allclose-style bounds: |out - ref| <= atol + rtol * |ref|."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class OpSpec:
    """An op: seeded inputs, a float64 reference, the bytes it must move and its tolerance."""

    name: str
    description: str
    make_inputs: Callable[[tuple[int, ...], torch.dtype, torch.device, int], Inputs]
    reference: Callable[[Inputs], torch.Tensor]
    bytes_moved: Callable[[tuple[int, ...], torch.dtype], int]
    tolerance: Callable[[torch.dtype], Tolerance]
    check_shape: Callable[[tuple[int, ...]], str | None]
    key_of: Callable[[Sequence[object]], tuple[tuple[int, ...], torch.dtype]]
    baseline: str
    default_variant: str

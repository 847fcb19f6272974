"""The op contract: what defines an operation independently of any lowering.

An op names its inputs and outputs; a variant's kernel takes the inputs in that order and returns
the outputs (one tensor when the op has one output, else a tuple in `outputs` order). The gate,
the trial, the tables, compare/profile and the Dispatcher work from this spec alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fusionlab.shapes import dtype_name

Shape = tuple[int, ...]
Inputs = tuple[object, ...]


@dataclass(frozen=True)
class Tolerance:
    """allclose-style bounds: |out - ref| <= atol + rtol * |ref|."""

    atol: float
    rtol: float


def key_of_first_input(inputs: Sequence[object]) -> tuple[Shape, torch.dtype]:
    """The dispatch key of most norms: the first input's shape and dtype."""
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor):
        raise TypeError(
            f"the first input must be a torch.Tensor (the one the call is keyed by), "
            f"not {type(first).__name__}"
        )
    dtype_name(first.dtype)  # a dtype no cell can hold is refused here, by name
    return tuple(first.shape), first.dtype


def nearest_rows_same_hidden(shape: Shape, candidates: Sequence[Shape]) -> Shape | None:
    """Among measured shapes with the same last (hidden) dim, the one with the nearest row count."""
    rows = math.prod(shape[:-1])
    same = [c for c in candidates if len(c) >= 1 and c[-1] == shape[-1]]
    if not same or not shape:
        return None
    return min(same, key=lambda c: abs(math.log(max(math.prod(c[:-1]), 1) / max(rows, 1))))


def last_dim_norm_shape_error(shape: Shape) -> str | None:
    """Norms over the last dimension need at least one dimension."""
    return None if len(shape) >= 1 else "the op normalises the last dimension: give at least one"


@dataclass(frozen=True)
class OpSpec:
    """An op: named inputs/outputs, seeded inputs, float64 references, bytes, tolerance, roles."""

    name: str
    description: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    make_inputs: Callable[[Shape, torch.dtype, torch.device, int], Inputs]
    # float64 references on the CPU, one per output, in `outputs` order.
    reference: Callable[[Inputs], tuple[torch.Tensor, ...]]
    bytes_moved: Callable[[Shape, torch.dtype], int]
    tolerance: Callable[[torch.dtype], Tolerance]
    baseline: str  # the variant every speedup is measured against (the naive chain)
    builtin: str  # the framework's own lowering: a second reference point and the fallback
    default_shapes: str
    quick_shapes: str
    check_shape: Callable[[Shape], str | None] = last_dim_norm_shape_error
    key_of: Callable[[Sequence[object]], tuple[Shape, torch.dtype]] = key_of_first_input
    nearest: Callable[[Shape, Sequence[Shape]], Shape | None] = nearest_rows_same_hidden
    # The backward: the inputs it differentiates (none: the op has no backward to sweep) and
    # the float64 reference as differentiable ops of float64 CPU inputs (no detach), whose
    # autograd gradients the gradient gate compares against.
    grad_inputs: tuple[str, ...] = ()
    grad_reference: Callable[[Inputs], tuple[torch.Tensor, ...]] | None = None
    # Each row of every output depends only on that row of the inputs shaped like the first
    # (a norm over the last dim): the gate may then recompute one row's reference, not all.
    rowwise: bool = False

    def as_outputs(self, result: object) -> tuple[object, ...]:
        """A kernel's return value as a tuple in `outputs` order (not yet checked)."""
        if len(self.outputs) == 1 and not isinstance(result, (tuple, list)):
            return (result,)
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

"""One call registers a row-wise norm op from what makes it that op: its float64 math, its named
inputs and outputs, how it draws them, the tensors it moves and its shapes. What every norm op
shares is derived here: the detached and differentiable references, the tolerance (one per dtype)
and the roles of the naive and builtin variants."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fusionlab.kernels.common.tolerances import TOLERANCES
from fusionlab.op import Inputs, OpSpec, Shape, Tolerance
from fusionlab.registry import register_op

Float64Math = Callable[..., "torch.Tensor | tuple[torch.Tensor, ...]"]
"""The op in float64 on the CPU from its tensors and eps; differentiable (no detach)."""


def float64_reference(float64: Float64Math, inputs: Inputs,
                      detach: bool = True) -> tuple[torch.Tensor, ...]:
    """`float64` of the inputs (detached unless `detach` is False), as a tuple of outputs."""
    *tensors, eps = inputs
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    if detach:
        tensors = [t.detach() for t in tensors]  # type: ignore[union-attr]
    result = float64(*tensors, float(eps))  # type: ignore[arg-type]
    return result if isinstance(result, tuple) else (result,)


def tolerance(dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[dtype]


def register_norm_op(
    *, name: str, description: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
    make_inputs: Callable[[Shape, torch.dtype, torch.device, int], Inputs],
    float64: Float64Math, rows_moved: int, vectors_moved: int, moved: str, default_shapes: str,
    quick_shapes: str,
) -> OpSpec:
    """Register the op: every input but eps is differentiated; it moves `rows_moved` tensors of
    the input's shape (read and written) and reads `vectors_moved` of its last dim, which
    `moved` says in words (its bytes_moved's docstring)."""

    def reference(op_inputs: Inputs) -> tuple[torch.Tensor, ...]:
        return float64_reference(float64, op_inputs)

    def grad_reference(op_inputs: Inputs) -> tuple[torch.Tensor, ...]:
        return float64_reference(float64, op_inputs, detach=False)

    def bytes_moved(shape: Shape, dtype: torch.dtype) -> int:
        return (rows_moved * math.prod(shape) + vectors_moved * shape[-1]) * dtype.itemsize

    bytes_moved.__doc__ = moved

    return register_op(OpSpec(
        name=name, description=description, inputs=inputs, outputs=outputs,
        make_inputs=make_inputs, reference=reference, bytes_moved=bytes_moved,
        tolerance=tolerance, baseline="naive", builtin="builtin", default_shapes=default_shapes,
        quick_shapes=quick_shapes, grad_inputs=inputs[:-1], grad_reference=grad_reference,
        rowwise=True,
    ))

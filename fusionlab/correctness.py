"""The correctness gate every trial passes before its timing counts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionlab.op import Tolerance
from fusionlab.records import Accuracy


class IncorrectOutput(Exception):
    """The output disagrees with the reference, or the call broke a rule (mutation, aliasing)."""


def check_output(
    out: object,
    reference: torch.Tensor,
    like: torch.Tensor,
    tolerance: Tolerance,
) -> Accuracy:
    """Check shape, dtype, device, finiteness and error against the float64 reference."""
    if not isinstance(out, torch.Tensor):
        raise IncorrectOutput(f"returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(reference.shape):
        raise IncorrectOutput(f"shape {tuple(out.shape)}, expected {tuple(reference.shape)}")
    if out.dtype != like.dtype:
        raise IncorrectOutput(f"dtype {out.dtype}, expected {like.dtype}")
    if out.device != like.device:
        raise IncorrectOutput(f"device {out.device}, expected {like.device}")
    got = out.detach().to("cpu", torch.float64)
    if not torch.isfinite(got).all():
        raise IncorrectOutput("output has NaN or Inf values")
    error = (got - reference).abs()
    bound = tolerance.atol + tolerance.rtol * reference.abs()
    accuracy = Accuracy(
        max_abs_err=float(error.max()),
        max_rel_err=float((error / reference.abs().clamp_min(1e-12)).max()),
        atol=tolerance.atol,
        rtol=tolerance.rtol,
    )
    if bool((error > bound).any()):
        worst = int((error - bound).argmax())
        raise IncorrectOutput(
            f"max abs error {accuracy.max_abs_err:.3g} exceeds atol={tolerance.atol:g} + "
            f"rtol={tolerance.rtol:g}*|ref| (worst at flat index {worst})"
        )
    return accuracy


def tensors_in(inputs: Sequence[object]) -> list[torch.Tensor]:
    return [item for item in inputs if isinstance(item, torch.Tensor)]


def snapshot(inputs: Sequence[object]) -> list[torch.Tensor]:
    """Copies of the input tensors, to detect mutation later."""
    return [tensor.detach().clone() for tensor in tensors_in(inputs)]


def check_not_mutated(inputs: Sequence[object], copies: list[torch.Tensor]) -> None:
    for index, (tensor, copy) in enumerate(zip(tensors_in(inputs), copies, strict=True)):
        if not torch.equal(tensor, copy):
            raise IncorrectOutput(f"the call modified input tensor #{index}")


def check_no_alias(out: torch.Tensor, inputs: Sequence[object]) -> None:
    """The output must own fresh memory, not a view of an input."""
    out_storage = out.untyped_storage()
    start = out_storage.data_ptr()
    end = start + out_storage.nbytes()
    for index, tensor in enumerate(tensors_in(inputs)):
        storage = tensor.untyped_storage()
        other = storage.data_ptr()
        if other < end and start < other + storage.nbytes():
            raise IncorrectOutput(f"the output aliases input tensor #{index}")

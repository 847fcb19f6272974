"""The correctness gate: values against float64, memory rules, and declared in-place writes.

Every rule that fails raises `GateFailure` with the status it earns and a one-line reason.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fusionlab.measure import rules
from fusionlab.op import Inputs, OpSpec, Tolerance
from fusionlab.records import Accuracy, Status


class GateFailure(Exception):
    """A trial broke a rule of the gate."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_values(
    outputs: Sequence[object],
    references: Sequence[torch.Tensor],
    spec: OpSpec,
    like: torch.Tensor,
    tolerance: Tolerance | Sequence[Tolerance],
    when: str = "",
) -> Accuracy:
    """Shape, dtype, device, finiteness and error of every output against its float64 reference
    (`tolerance`: one for every output, or one per output)."""
    worst: Accuracy | None = None
    if len(outputs) != len(spec.outputs):
        raise GateFailure(
            Status.INCORRECT, f"returned {len(outputs)} outputs, expected {len(spec.outputs)}"
        )
    bounds = [tolerance] * len(outputs) if isinstance(tolerance, Tolerance) else list(tolerance)
    for name, out, reference, bound in zip(spec.outputs, outputs, references, bounds, strict=True):
        where = f"{name}{' ' + when if when else ''}"
        if not isinstance(out, torch.Tensor):
            raise GateFailure(Status.INCORRECT, f"{where}: returned {type(out).__name__}")
        if rules.on("plain_dense_outputs") and (
                type(out) is not torch.Tensor or out.layout is not torch.strided):
            # A subclass or another layout can compute its values when read, not when called.
            raise GateFailure(
                Status.INCORRECT,
                f"{where}: returned a {type(out).__name__} ({out.layout}); outputs must be plain "
                "dense torch.Tensor (a subclass may compute its values only when read)",
            )
        if tuple(out.shape) != tuple(reference.shape):
            raise GateFailure(
                Status.INCORRECT,
                f"{where}: shape {tuple(out.shape)}, expected {tuple(reference.shape)}",
            )
        if out.dtype != like.dtype:
            message = f"{where}: dtype {out.dtype}, expected {like.dtype}"
            raise GateFailure(Status.INCORRECT, message)
        if out.device != like.device:
            raise GateFailure(
                Status.INCORRECT, f"{where}: device {out.device}, expected {like.device}"
            )
        accuracy = _error_against(out, reference, bound, where)
        if worst is None or accuracy.max_abs_err > worst.max_abs_err:
            worst = accuracy
    assert worst is not None
    return worst


FLOAT32_CHECK_FLOOR = 1e-5
"""Outputs of 32 bits or fewer are compared in float32 when both tolerances are at least this:
the reference's rounding to float32 (half an ulp, under 6e-8 of |ref|) is then 150x below the
tightest bound, and the check moves half the bytes of a float64 one
(`python benchmarks/gate_check.py` times both side by side)."""


CHECK_BLOCK = 1 << 18
"""Elements compared at a time. The block's three work buffers (6 MiB at most, in float64) stay
in the caches, so a check reads the output and its reference from memory once, where comparing
whole tensors made a dozen passes over fresh buffers of the output's size
(`python benchmarks/gate_check.py` times both side by side)."""


@dataclass
class _Worst:
    """What the blocks of one comparison found so far: the largest absolute and relative errors,
    whether every error was finite, and the least slack (bound - error; below 0: past the bound)
    with its flat index."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    finite: bool = True
    slack: float = math.inf
    index: int = -1


def _error_against(
    out: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance, where: str
) -> Accuracy:
    """Finiteness and error of one output against its reference, a block at a time through
    three reused buffers (the audit checks every sample: this is its hot path)."""
    exact = (
        out.element_size() > 4 or min(tolerance.atol, tolerance.rtol) < FLOAT32_CHECK_FLOOR
    )
    work = torch.float64 if exact else torch.float32
    flat_out, flat_ref = out.detach().reshape(-1), reference.reshape(-1)
    size = min(flat_out.numel(), CHECK_BLOCK) or 1
    buffers = [torch.empty(size, dtype=work, device="cpu") for _ in range(3)]
    worst = _Worst()
    for start in range(0, flat_out.numel(), size):
        stop = min(start + size, flat_out.numel())
        _compare_block(flat_out[start:stop], flat_ref[start:stop], tolerance,
                       [b[: stop - start] for b in buffers], start, worst)
        if not worst.finite:
            break
    if not worst.finite:  # NaN and Inf propagate to a block's max
        raise GateFailure(Status.INCORRECT, f"{where}: output has NaN or Inf values")
    if worst.slack < 0:
        raise GateFailure(
            Status.INCORRECT,
            f"{where}: max abs error {worst.max_abs:.3g} exceeds atol={tolerance.atol:g}"
            f" + rtol={tolerance.rtol:g}*|ref| (worst at flat index {worst.index})",
        )
    return Accuracy(max_abs_err=worst.max_abs, max_rel_err=worst.max_rel, atol=tolerance.atol,
                    rtol=tolerance.rtol)


def _compare_block(
    out: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance,
    buffers: list[torch.Tensor], offset: int, worst: _Worst,
) -> None:
    """Compare one block (`offset`: its first flat index) into `worst`, in the buffers' dtype:
    the output and the reference are only read."""
    error, magnitude, slack = buffers
    magnitude.copy_(reference)  # the reference rounded to the work dtype
    torch.sub(out.to(error.device), magnitude, out=error).abs_()  # in the work dtype
    magnitude.abs_()
    block_abs = float(error.max())
    worst.finite = math.isfinite(block_abs)
    if not worst.finite:
        return
    worst.max_abs = max(worst.max_abs, block_abs)
    if rules.on("error_bound"):
        # bound - error, negative exactly where error > bound (a float difference of two
        # unequal values is never zero and keeps their order's sign).
        torch.mul(magnitude, tolerance.rtol, out=slack).add_(tolerance.atol).sub_(error)
        least, where = slack.min(0)
        if float(least) < worst.slack:
            worst.slack, worst.index = float(least), offset + int(where)
    worst.max_rel = max(worst.max_rel, float(error.div_(magnitude.clamp_min_(1e-12)).max()))


def check_memory(
    outputs: Sequence[object],
    inputs: Inputs,
    spec: OpSpec,
    inplace: Mapping[str, str],
    held: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Fresh memory for every output not declared in place; declared ones written in place.

    `held` are outputs of earlier calls the caller still holds: handing their storage out again
    would silently overwrite them. Returns the fresh outputs, for the caller to hold.
    """
    tensors = {name: value for name, value in zip(spec.inputs, inputs, strict=True)}
    fresh: list[torch.Tensor] = []
    for name, out in zip(spec.outputs, outputs, strict=True):
        assert isinstance(out, torch.Tensor)
        if name in inplace:
            target = tensors[inplace[name]]
            assert isinstance(target, torch.Tensor)
            if not shares_memory(out, target) or out.data_ptr() != target.data_ptr():
                raise GateFailure(
                    Status.INCORRECT,
                    f"{name} is declared in place in {inplace[name]!r} but was returned elsewhere",
                )
            continue
        for input_name, tensor in tensors.items():
            if (isinstance(tensor, torch.Tensor) and shares_memory(out, tensor)
                    and rules.on("no_input_alias")):
                raise GateFailure(Status.REUSED_MEMORY, f"{name} aliases input {input_name!r}")
        for earlier in [*held, *fresh]:
            if shares_memory(out, earlier):
                raise GateFailure(
                    Status.REUSED_MEMORY,
                    f"{name} reuses the storage of an output the caller still holds",
                )
        fresh.append(out)
    return fresh


def check_not_retained(outputs: list[object], what: str = "a timed call") -> None:
    """No output, nor its storage, may still be held by the variant once it returned it (a
    buffer it hands out again, a ring, a cache, a thread still writing it).

    `outputs` must hold the caller's only reference to each tensor (each tensor once); other
    items are left to check_values.
    """
    for i in range(len(outputs)):
        if not isinstance(outputs[i], torch.Tensor):
            continue
        # Ours: the list entry and getrefcount's argument. A view's base: the argument and the
        # view's own (torch keeps a Python object alive while C++ still owns its tensor).
        extra_refs = sys.getrefcount(outputs[i]) - 2
        has_base = outputs[i]._base is not None
        base_refs = sys.getrefcount(outputs[i]._base) - 2 if has_base else 0
        # Storage holders: this tensor, its view base, and the temporary storage object.
        holders = torch._C._storage_Use_Count(outputs[i].untyped_storage()._cdata)
        if rules.on("not_retained") and (
                extra_refs > 0 or base_refs > 0 or holders > 2 + has_base):
            raise GateFailure(
                Status.REUSED_MEMORY,
                f"the output of {what} is still held by the variant after it returned it "
                "(a buffer it hands out again: a ring, a cache or a thread still writing it)",
            )


def check_mutation(
    inputs: Inputs, copies: Sequence[torch.Tensor], spec: OpSpec, inplace: Mapping[str, str]
) -> None:
    """Inputs change only where the variant declares an in-place output, and there they must."""
    declared = set(inplace.values())
    tensors = [
        (n, v) for n, v in zip(spec.inputs, inputs, strict=True) if isinstance(v, torch.Tensor)
    ]
    for (name, tensor), copy in zip(tensors, copies, strict=True):
        if (name not in declared and not torch.equal(tensor, copy)
                and rules.on("undeclared_mutation")):
            raise GateFailure(
                Status.INCORRECT, f"the call modified input {name!r}, which it does not declare"
            )


def snapshot(inputs: Inputs) -> list[torch.Tensor]:
    """Copies of the input tensors, to detect mutation later."""
    return [item.detach().clone() for item in inputs if isinstance(item, torch.Tensor)]


def refill_in_place(inputs: Inputs, values: Inputs) -> None:
    """Write new values into the same tensors (same address) without bumping their version."""
    for target, source in zip(inputs, values, strict=True):
        if isinstance(target, torch.Tensor) and isinstance(source, torch.Tensor):
            target.data.copy_(source)

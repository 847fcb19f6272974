"""The gate's value check (fusionlab/measure/correctness.py) on real tensors: it tells an output
just inside its tolerance from one just outside, in the float32 comparison it uses for 32-bit
and 16-bit outputs and in the float64 one it keeps for tolerances too tight for float32."""

from __future__ import annotations

import pytest
import torch

from fusionlab.measure import correctness
from fusionlab.measure.correctness import FLOAT32_CHECK_FLOOR, GateFailure, check_values
from fusionlab.op import Tolerance
from fusionlab.records import Status
from fusionlab.registry import get_op

SPEC = get_op("rmsnorm")


def _reference(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = SPEC.make_inputs((64, 512), dtype, "cpu", 3)
    (reference,) = SPEC.reference(inputs)
    return reference, reference.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_error_just_past_the_bound_fails_and_just_inside_passes(dtype: torch.dtype) -> None:
    reference, out = _reference(dtype)
    tolerance = SPEC.tolerance(dtype)
    index = 1234
    bound = tolerance.atol + tolerance.rtol * abs(float(reference.view(-1)[index]))
    rounding = abs(float(out.double().view(-1)[index] - reference.view(-1)[index]))
    for step, fails in ((1.3, True), (0.5, False)):
        bad = out.clone()
        bad.view(-1)[index] = (reference.view(-1)[index] + step * bound + rounding).to(dtype)
        if fails:
            with pytest.raises(GateFailure) as caught:
                check_values([bad], [reference], SPEC, out, tolerance)
            assert caught.value.status is Status.INCORRECT
            assert f"worst at flat index {index}" in str(caught.value)
        else:
            accuracy = check_values([bad], [reference], SPEC, out, tolerance)
            assert accuracy.max_abs_err <= bound


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_outputs_fail(value: float) -> None:
    reference, out = _reference(torch.float32)
    out.view(-1)[77] = value
    with pytest.raises(GateFailure, match="NaN or Inf"):
        check_values([out], [reference], SPEC, out, SPEC.tolerance(torch.float32))


def test_a_tolerance_too_tight_for_float32_is_checked_in_float64() -> None:
    """A float32 output that is the reference rounded to float32 is off by that rounding
    (about 4.7e-11 at 1e-3): a float32 comparison would see no error at all, the float64 one
    it falls back to for a 1e-12 tolerance sees it."""
    tight = Tolerance(1e-12, 1e-12)
    assert min(tight.atol, tight.rtol) < FLOAT32_CHECK_FLOOR
    reference = torch.full((4, 8), 1e-3, dtype=torch.float64)
    out = reference.to(torch.float32)
    assert float(out[0, 0].double() - reference[0, 0]) != 0.0
    with pytest.raises(GateFailure, match="exceeds atol=1e-12"):
        check_values([out], [reference], SPEC, out, tight)
    check_values([out], [reference], SPEC, out, SPEC.tolerance(torch.float32))


def test_the_check_leaves_the_reference_and_the_output_alone() -> None:
    reference, out = _reference(torch.float32)
    kept_reference, kept_out = reference.clone(), out.clone()
    check_values([out], [reference], SPEC, out, SPEC.tolerance(torch.float32))
    assert torch.equal(reference, kept_reference) and torch.equal(out, kept_out)


def test_a_check_in_blocks_finds_what_the_whole_tensor_shows(monkeypatch) -> None:
    """Blocks of 1000 elements over 32768 (the last one partial): the same errors as one block,
    the worst element named by its flat index across blocks, and a NaN in the last element."""
    reference, out = _reference(torch.float32)
    tolerance = SPEC.tolerance(torch.float32)
    whole = check_values([out], [reference], SPEC, out, tolerance)
    monkeypatch.setattr(correctness, "CHECK_BLOCK", 1000)
    assert check_values([out], [reference], SPEC, out, tolerance) == whole
    flat = reference.view(-1)
    bad = out.clone()
    for index, step in ((5, 2.0), (31500, 9.0), (20000, 4.0)):
        bound = tolerance.atol + tolerance.rtol * abs(float(flat[index]))
        bad.view(-1)[index] = float(flat[index]) + step * bound
    with pytest.raises(GateFailure, match="worst at flat index 31500"):
        check_values([bad], [reference], SPEC, out, tolerance)
    bad.view(-1)[-1] = float("nan")
    with pytest.raises(GateFailure, match="NaN or Inf"):
        check_values([bad], [reference], SPEC, out, tolerance)

"""Parsing of what users type, and the RMSNorm spec's inputs and reference."""

import pytest
import torch

from fusionlab.errors import UserError
from fusionlab.measure.stats import summarise
from fusionlab.registry import get_op
from fusionlab.shapes import format_shape, parse_dtypes, parse_shape, parse_shapes


def test_shapes_parse_and_round_trip() -> None:
    assert parse_shape("4x2048x4096") == (4, 2048, 4096)
    assert parse_shapes("1x8, 2x8,1x8") == [(1, 8), (2, 8)]
    assert format_shape((32, 4096)) == "32x4096"


@pytest.mark.parametrize(
    "text", ["0x4096", "4x", "abc", "x8", "-1x8", "2.5x8", "", "4x4096,,8x4096", "4x4096,"]
)
def test_malformed_shapes_are_user_errors(text: str) -> None:
    with pytest.raises(UserError):
        parse_shapes(text)


def test_dtype_aliases_and_unknown() -> None:
    assert parse_dtypes("fp32,bf16,float16") == ["float32", "bfloat16", "float16"]
    with pytest.raises(UserError, match="unknown dtype"):
        parse_dtypes("float8")


def test_summary_statistics() -> None:
    summary = summarise([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (summary.median, summary.q1, summary.q3, summary.minimum) == (3.0, 2.0, 4.0, 1.0)
    assert summary.relative_iqr == pytest.approx(2 / 3)


def test_rmsnorm_inputs_are_seeded_and_weight_is_not_trivial() -> None:
    spec = get_op("rmsnorm")
    x, weight, eps = spec.make_inputs((3, 64), torch.bfloat16, torch.device("cpu"), 7)
    again = spec.make_inputs((3, 64), torch.bfloat16, torch.device("cpu"), 7)
    other = spec.make_inputs((3, 64), torch.bfloat16, torch.device("cpu"), 8)
    assert torch.equal(x, again[0]) and not torch.equal(x, other[0])
    assert x.dtype == weight.dtype == torch.bfloat16 and weight.shape == (64,)
    assert weight.float().std() > 0.2 and not torch.all(weight == 1)
    assert eps > 0


def test_reference_is_float64_rmsnorm_and_bytes_moved() -> None:
    spec = get_op("rmsnorm")
    inputs = spec.make_inputs((2, 3, 16), torch.float32, torch.device("cpu"), 0)
    (ref,) = spec.reference(inputs)
    x, weight, eps = inputs
    assert ref.dtype == torch.float64
    expected = torch.rms_norm(x.double(), (16,), weight.double(), eps)
    torch.testing.assert_close(ref, expected)
    assert spec.bytes_moved((2, 3, 16), torch.bfloat16) == (2 * 96 + 16) * 2

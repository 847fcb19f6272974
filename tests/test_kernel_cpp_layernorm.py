"""Tests for the hand-written C++ LayerNorm CPU operator (fusionlab::layer_norm_cpu)."""

from __future__ import annotations

import helpers
import pytest
import torch

from fusionlab.kernels import cpu_store
from fusionlab.kernels.layernorm import cpu_cpp

_UNAVAILABLE = cpu_cpp.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")

EPS = 1e-5
ROWS_PER_TASK = cpu_cpp.TUNABLES["rows_per_task"]
TOL = helpers.rounding_tol(atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def loaded() -> None:
    """Builds (first run per cache) or loads the extension once for this module."""
    cpu_cpp.load_extension()


def make(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, offset: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (offset + torch.randn(shape, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    bias = (0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, weight, bias


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    var = (xd - mean).square().mean(-1, keepdim=True)
    return (xd - mean) * torch.rsqrt(var + EPS) * weight.double() + bias.double()


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, rows_per_task: int = 4,
          tol: dict[str, float] | None = None) -> None:
    y = cpu_cpp.layer_norm_cpp(x, weight, bias, EPS, rows_per_task)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.double(), reference(x, weight, bias), **(tol or TOL[x.dtype]))


@helpers.over_cpp_cases(ROWS_PER_TASK, widest=(3, 8192))
def test_matches_float64_reference(shape, dtype, rows_per_task):
    check(*make(shape, dtype), rows_per_task)


def test_float16():
    check(*make((3, 1000), torch.float16))


@pytest.mark.parametrize("shape", [(4, 4096), (2, 1000)], ids=["4x4096", "2x1000"])
def test_large_mean_does_not_cancel(shape):
    # mean/std = 1000: var = E[x^2] - E[x]^2 from fp32 lane sums is off by up to 30% here and the
    # output by ~1e-1; Welford's error stays at fp32 roundoff of the mean (~1e-4 of a std).
    x, weight, bias = make(shape, torch.float32, seed=5, offset=1000.0)
    check(x, weight, bias, tol={"rtol": 0.0, "atol": 3e-4})


@pytest.mark.parametrize("stats", cpu_store.STATS_CHOICES)
@pytest.mark.parametrize("shape", [(5, 4097), (4, 33), (1, 7)], ids=["5x4097", "4x33", "1x7"])
def test_bf16_rows_far_from_zero_keep_the_output_rounding(shape, stats):
    # mean / std is about 1200 here (1000 + N(0, 1) in bf16 steps of 8). x * rstd - mean * rstd,
    # one fma fewer than (x - mean) * rstd, fails this: its fp32 rounding at |x * rstd| ~ 1200 is
    # up to 6e-5, over half a bf16 ulp of the small outputs where x is near the mean and w * x
    # cancels b (torch.layer_norm itself, which takes that form, misses 163 of these elements).
    # Widths with a scalar tail; every statistics path and row grouping the shape allows.
    x, weight, bias = make(shape, torch.bfloat16, seed=7, offset=1000.0)
    expected = reference(x, weight, bias)
    for row_group in cpu_store.ROW_GROUP_CHOICES:
        if cpu_cpp.param_error(shape, 1, "plain", stats, row_group) is None:
            y = cpu_cpp.layer_norm_cpp(x, weight, bias, EPS, 1, "plain", stats, row_group)
            torch.testing.assert_close(y.double(), expected, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_output_streaming_path(dtype):
    x, weight, bias = make(helpers.streamed_shape(dtype), dtype, seed=1)
    helpers.assert_streams(lambda: cpu_cpp.layer_norm_cpp(x, weight, bias, EPS, 16), x,
                   reference(x, weight, bias), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    base, _, _ = make((6, 8, 130), dtype, seed=2)
    for name, x in helpers.strided_views(base).items():
        assert not x.is_contiguous(), name
        before = base.clone()
        check(x, *make(x.shape, dtype, seed=3)[1:])
        assert torch.equal(base, before), name


def test_parameter_dtypes_are_converted():
    x, weight, bias = make((4, 300), torch.bfloat16)
    check(x, weight.float(), bias.float())


def test_empty_input():
    x, weight, bias = make((0, 64), torch.float32)
    assert cpu_cpp.layer_norm_cpp(x, weight, bias, EPS, 1).shape == (0, 64)


@pytest.mark.parametrize(
    ("weight", "bias", "eps", "rows_per_task", "match"),
    [
        (torch.ones(63), torch.zeros(64), EPS, 1, "weight and bias must be 1-D of size 64"),
        (torch.ones(64), torch.zeros(1, 64), EPS, 1, "weight and bias must be 1-D"),
        (torch.ones(64), torch.zeros(64), -1.0, 1, "eps must be >= 0"),
        (torch.ones(64), torch.zeros(64), EPS, 0, "rows_per_task must be >= 1"),
        (torch.ones(64), torch.zeros(64, dtype=torch.float64), EPS, 1, "dtypes must be"),
    ],
)
def test_rejects_bad_arguments(weight, bias, eps, rows_per_task, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_cpp.layer_norm_cpp(torch.randn(4, 64), weight, bias, eps, rows_per_task)


def test_profiler_sees_one_op_record_per_call():
    x, weight, bias = make((64, 512), torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            cpu_cpp.layer_norm_cpp(x, weight, bias, EPS, 4)
    assert [event.name for event in prof.events()] == ["fusionlab::layer_norm_cpu"] * 3


def test_module_contract():
    assert set(cpu_cpp.TUNABLES) == {"rows_per_task", "store", "stats", "row_group"}
    helpers.assert_cpp_contract(cpu_cpp)

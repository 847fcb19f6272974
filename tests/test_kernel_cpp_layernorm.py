"""Tests for the hand-written C++ LayerNorm CPU operator (fusionlab::layer_norm_cpu)."""

from __future__ import annotations

import resource

import pytest
import torch

from fusionlab.kernels.layernorm import cpu_cpp

_UNAVAILABLE = cpu_cpp.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")

EPS = 1e-5
ROWS_PER_TASK = cpu_cpp.TUNABLES["rows_per_task"]
# One rounding of the fp32 result: a unit roundoff of the output type plus fp32 error.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-8 + 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2**-11 + 1e-5, "atol": 1e-5},
}


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


SHAPES = [
    (1, 4096), (4096,), (1, 1), (5, 7), (3, 1000), (2, 5000), (3, 5, 96), (37, 130), (3, 8192)
]


@pytest.mark.parametrize("rows_per_task", ROWS_PER_TASK)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_output_streaming_path(dtype):
    # 8 MiB and up is written with non-temporal stores when the output's pages are already mapped
    # and with plain stores when they are fresh. An early call may get fresh pages; once malloc
    # reuses a freed block, the output faults no pages and takes the streaming path.
    rows = (8 << 20) // (2048 * dtype.itemsize)
    x, weight, bias = make((rows, 2048), dtype, seed=1)
    pages = x.nbytes // resource.getpagesize()
    expected = reference(x, weight, bias)
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y = cpu_cpp.layer_norm_cpp(x, weight, bias, EPS, 16)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        torch.testing.assert_close(y.double(), expected, **TOL[dtype])
        del y
    assert min(faults) < pages // 2, f"no call reused a mapped output: {faults} faults of {pages}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    base, _, _ = make((6, 8, 130), dtype, seed=2)
    views = {
        "transposed": base[0].t(),  # last-dim stride != 1: copied
        "column slice": base[..., 3:103],  # uniform row stride, read in place
        "row step": base[:, ::2],
        "permuted": base.permute(1, 0, 2),  # rows not at a uniform stride: copied
        "expanded": base[0, :1].expand(5, 130),  # row stride 0
    }
    for name, x in views.items():
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
    assert all(cpu_cpp.param_error((2, 64), rows_per_task=r) is None for r in ROWS_PER_TASK)
    assert cpu_cpp.param_error((2, 64), rows_per_task=0) is not None
    # "stream" only where it can take effect: big enough, rows of whole 64-byte lines.
    assert cpu_cpp.param_error((2048, 4096), rows_per_task=1, store="stream") is None
    assert "smaller outputs" in cpu_cpp.param_error((2, 64), rows_per_task=1, store="stream")
    assert "multiple of 32" in cpu_cpp.param_error((8192, 100), rows_per_task=1, store="stream")
    assert cpu_cpp.load_extension() == 0.0

"""Tests for the hand-written C++ add + RMSNorm CPU operators (fusionlab::add_rms_norm_cpu and
its in-place flavour fusionlab::add_rms_norm_cpu_)."""

from __future__ import annotations

import helpers
import pytest
import torch

from fusionlab.kernels.add_rmsnorm import cpu_cpp

_UNAVAILABLE = cpu_cpp.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")

EPS = 1e-6
ROWS_PER_TASK = cpu_cpp.TUNABLES["rows_per_task"]
# residual_out is the fp32 sum rounded once; out is the fp32 result rounded once.
TOL = helpers.rounding_tol(atol=1e-6)
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Pair = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module", autouse=True)
def loaded() -> None:
    """Builds (first run per cache) or loads the extension once for this module."""
    cpu_cpp.load_extension()


def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> Triple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    residual = (2 * torch.randn(shape, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, residual, weight


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Pair:
    total = x.double() + residual.double()
    out = total * torch.rsqrt(total.square().mean(-1, keepdim=True) + EPS) * weight.double()
    return out, total


def check_values(result: Pair, x: torch.Tensor, expected: Pair) -> None:
    for got, want in zip(result, expected, strict=True):
        assert got.dtype == x.dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, **TOL[x.dtype])


def check_out_of_place(x, residual, weight, rows_per_task: int = 4) -> None:
    """Runs the out-of-place op; checks values, fresh contiguous outputs and untouched inputs."""
    before = [t.clone() for t in (x, residual, weight)]
    out, res = cpu_cpp.add_rms_norm_cpp(x, residual, weight, EPS, rows_per_task)
    check_values((out, res), x, reference(*before))
    assert out.is_contiguous() and res.is_contiguous()
    for name, t, saved in zip(("x", "residual", "weight"), (x, residual, weight), before,
                              strict=True):
        assert torch.equal(t, saved), f"{name} was modified"
        for result in (out, res):
            assert result.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def check_in_place(x, residual, weight, rows_per_task: int = 4) -> None:
    """Runs the in-place op; checks it wrote exactly x and residual, and returned them."""
    expected = reference(x, residual, weight)
    # Same arithmetic as the out-of-place op, so the same bits.
    oop = cpu_cpp.add_rms_norm_cpp(x, residual, weight, EPS, rows_per_task)
    weight_before = weight.clone()
    got = cpu_cpp.add_rms_norm_cpp_(x, residual, weight, EPS, rows_per_task)
    assert got[0] is x and got[1] is residual
    check_values(got, x, expected)
    assert torch.equal(x, oop[0]) and torch.equal(residual, oop[1])
    assert torch.equal(weight, weight_before)


@helpers.over_cpp_cases(ROWS_PER_TASK, widest=(2, 8192))
def test_matches_float64_reference(shape, dtype, rows_per_task):
    check_out_of_place(*make(shape, dtype), rows_per_task)
    check_in_place(*make(shape, dtype), rows_per_task)


def test_float16():
    check_out_of_place(*make((3, 1000), torch.float16))
    check_in_place(*make((3, 1000), torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_output_streaming_path(dtype):
    x, residual, weight = make(helpers.streamed_shape(dtype), dtype, seed=1)  # two 8 MiB outputs
    helpers.assert_streams(lambda: cpu_cpp.add_rms_norm_cpp(x, residual, weight, EPS, 16), x,
                   reference(x, residual, weight), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    for name in helpers.strided_views(torch.empty(6, 8, 130), expanded=False):
        x_base, r_base, _ = make((6, 8, 130), dtype, seed=2)
        x, residual = helpers.strided_views(x_base)[name], helpers.strided_views(r_base)[name]
        weight = make(x.shape, dtype, seed=3)[2]
        assert not x.is_contiguous() and not residual.is_contiguous(), name
        check_out_of_place(x, residual, weight)
        # In place writes through the views and nowhere else in their bases.
        outside_x, outside_r = x_base.clone(), r_base.clone()
        check_in_place(x, residual, weight)
        untouched = torch.ones_like(x_base, dtype=torch.bool)
        helpers.strided_views(untouched)[name].fill_(False)
        assert torch.equal(x_base[untouched], outside_x[untouched]), name
        assert torch.equal(r_base[untouched], outside_r[untouched]), name


def test_mixed_layouts_and_weight_dtype():
    x, residual, weight = make((4, 300), torch.bfloat16)
    wide = torch.empty(4, 400, dtype=torch.bfloat16)
    wide[:, :300] = residual
    check_out_of_place(x, wide[:, :300], weight.float())
    check_in_place(x, wide[:, :300], weight.float())


def test_in_place_rejects_overlapping_inputs():
    x, _, weight = make((4, 64), torch.float32)
    with pytest.raises(RuntimeError, match="single memory location"):
        cpu_cpp.add_rms_norm_cpp_(x, x, weight, EPS, 1)
    with pytest.raises(RuntimeError, match="single memory location"):
        cpu_cpp.add_rms_norm_cpp_(x[:1].expand(4, 64), x.clone(), weight, EPS, 1)


def test_empty_input():
    x, residual, weight = make((0, 64), torch.float32)
    out, res = cpu_cpp.add_rms_norm_cpp(x, residual, weight, EPS, 1)
    assert out.shape == res.shape == (0, 64)
    got = cpu_cpp.add_rms_norm_cpp_(x, residual, weight, EPS, 1)
    assert got[0] is x and got[1] is residual


@pytest.mark.parametrize(
    ("residual", "weight", "eps", "rows_per_task", "match"),
    [
        (torch.randn(4, 63), torch.ones(64), EPS, 1, "residual must have x's shape"),
        (torch.randn(4, 64).bfloat16(), torch.ones(64), EPS, 1, "residual must have x's dtype"),
        (torch.randn(4, 64), torch.ones(63), EPS, 1, "weight must be 1-D of size 64"),
        (torch.randn(4, 64), torch.ones(64), -1.0, 1, "eps must be >= 0"),
        (torch.randn(4, 64), torch.ones(64), EPS, 0, "rows_per_task must be >= 1"),
        (torch.randn(4, 64), torch.ones(64, dtype=torch.float64), EPS, 1, "dtypes must be"),
    ],
)
def test_rejects_bad_arguments(residual, weight, eps, rows_per_task, match):
    for fn in (cpu_cpp.add_rms_norm_cpp, cpu_cpp.add_rms_norm_cpp_):
        with pytest.raises(RuntimeError, match=match):
            fn(torch.randn(4, 64), residual, weight, eps, rows_per_task)


def test_schemas_declare_what_is_mutated():
    schema = str(torch.ops.fusionlab.add_rms_norm_cpu_.default._schema)
    assert "Tensor(a!) x, Tensor(b!) residual, Tensor weight" in schema
    assert schema.endswith("-> ()")  # no aliasing output, so torch.compile can functionalize it
    assert "!" not in str(torch.ops.fusionlab.add_rms_norm_cpu.default._schema)


@pytest.mark.parametrize(
    ("fn", "name"),
    [(cpu_cpp.add_rms_norm_cpp, "fusionlab::add_rms_norm_cpu"),
     (cpu_cpp.add_rms_norm_cpp_, "fusionlab::add_rms_norm_cpu_")],
)
def test_profiler_sees_one_op_record_per_call(fn, name):
    x, residual, weight = make((64, 512), torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn(x, residual, weight, EPS, 4)
    assert [event.name for event in prof.events()] == [name] * 3


def test_module_contract():
    assert set(cpu_cpp.TUNABLES) == {"rows_per_task", "store"}
    assert set(cpu_cpp.INPLACE_TUNABLES) == {"rows_per_task", "passes", "task_bytes"}
    helpers.assert_cpp_contract(cpu_cpp)

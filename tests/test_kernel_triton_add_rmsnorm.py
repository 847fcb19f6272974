"""Triton fused residual add + RMSNorm, run on CPU tensors through the Triton interpreter."""

import os

# Triton reads this when kernels are decorated, so it must be set before the kernel module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest
import torch

pytest.importorskip("triton")

from triton_cases import VIEWS, assert_close_to, reference_tests

from fusionlab.kernels.add_rmsnorm import triton_kernel
from fusionlab.kernels.add_rmsnorm.triton_kernel import add_rms_norm_triton, add_rms_norm_triton_

EPS = 1e-6


def reference(x, residual, weight, eps):
    """(out, residual_out) in float64; out is normed from the exact, unrounded sum."""
    s = x.double() + residual.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), s


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, weight


def assert_close(actual: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert actual.shape == ref.shape
    assert_close_to(actual, ref, dtype)


def check(x, residual, weight, cfg):
    x0, r0 = x.clone(), residual.clone()
    out, residual_out = add_rms_norm_triton(x, residual, weight, EPS, **cfg)
    ref_out, ref_sum = reference(x, residual, weight, EPS)
    assert_close(out, ref_out, x.dtype)
    assert_close(residual_out, ref_sum, x.dtype)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # the out-of-place flavour
    return out, residual_out


(test_matches_float64_reference, test_every_tunable_value_is_exercised,
 test_default_hidden_tiles) = reference_tests(check, make_inputs, triton_kernel)


def test_bfloat16_sum_is_rounded_once_and_out_uses_the_fp32_sum():
    # Within 1 bf16 ulp of the exact values: the sum is rounded once (not x + r in bf16 and then
    # again), and out is rounded once from fp32 math on the unrounded sum.
    x, residual, weight = make_inputs((16, 128), torch.bfloat16, seed=8)
    cfg = {"block_size": 128, "rows_per_program": 8, "threads_per_row": 32}
    out, residual_out = add_rms_norm_triton(x, residual, weight, EPS, **cfg)
    for actual, ref in zip((out, residual_out), reference(x, residual, weight, EPS), strict=True):
        _, exponent = torch.frexp(ref)
        ulp = torch.ldexp(torch.ones_like(ref), exponent - 8)  # bf16 keeps 8 significant bits
        assert ((actual.double() - ref).abs() / ulp).max().item() < 1.01


CFG = {"block_size": 128, "rows_per_program": 4, "threads_per_row": 16}


@pytest.mark.parametrize("make_view", VIEWS)
def test_non_contiguous_inputs(make_view):
    x_base, r_base, _ = make_inputs((10, 200), torch.float32, seed=1)
    _, _, weight = make_inputs((100,), torch.float32, seed=2)
    # residual gets a different layout from x: its own slice of a wider, transposed tensor.
    r = r_base.t().contiguous().t()
    check(make_view(x_base), make_view(r), weight, CFG)


@pytest.mark.parametrize("make_view", [pytest.param(lambda t: t[:, :128], id="row-slice"), *VIEWS])
def test_in_place_writes_both_inputs(make_view):
    x_base, r_base, _ = make_inputs((10, 200), torch.bfloat16, seed=3)
    hidden = make_view(x_base).shape[-1]
    _, _, weight = make_inputs((hidden,), torch.bfloat16, seed=4)
    x, residual = make_view(x_base), make_view(r_base)
    out, residual_out = add_rms_norm_triton(x, residual, weight, EPS, **CFG)
    # Expected buffers: the views' elements replaced by the results, every other element kept.
    x_expected, r_expected = x_base.clone(), r_base.clone()
    make_view(x_expected).copy_(out)
    make_view(r_expected).copy_(residual_out)
    returned = add_rms_norm_triton_(x, residual, weight, EPS, **CFG)
    assert returned[0] is x and returned[1] is residual
    assert torch.equal(x_base, x_expected) and torch.equal(r_base, r_expected)


def test_in_place_contiguous_3d():
    x, residual, weight = make_inputs((2, 3, 48), torch.float32, seed=5)
    cfg = {"block_size": 64, "rows_per_program": 8, "threads_per_row": 4}
    out, residual_out = add_rms_norm_triton(x, residual, weight, EPS, **cfg)
    x_ptr = x.data_ptr()
    add_rms_norm_triton_(x, residual, weight, EPS, **cfg)
    assert x.data_ptr() == x_ptr
    assert torch.equal(x, out) and torch.equal(residual, residual_out)


def test_errors():
    x, residual, weight = make_inputs((2, 1000), torch.float32)
    cfg = {"block_size": 1024, "rows_per_program": 2, "threads_per_row": 64}
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm_triton(x, residual[:1], weight, EPS, **cfg)
    with pytest.raises(ValueError, match="parameter shape"):
        add_rms_norm_triton_(x, residual, weight[:10], EPS, **cfg)
    with pytest.raises(ValueError, match="masked"):
        add_rms_norm_triton(x, residual, weight, EPS, **{**cfg, "rows_per_program": 4})
    assert triton_kernel.param_error((2048, 4096), 4096, 2, 64) is None
    assert triton_kernel.unavailable_reason("cpu") is None

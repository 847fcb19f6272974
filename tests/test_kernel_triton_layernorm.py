"""Triton LayerNorm kernel, run on CPU tensors through the Triton interpreter."""

import os

# Triton reads this when kernels are decorated, so it must be set before the kernel module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest
import torch

pytest.importorskip("triton")

from triton_cases import VIEWS, assert_close_to, reference_tests

from fusionlab.kernels.layernorm import triton_kernel
from fusionlab.kernels.layernorm.triton_kernel import (
    layer_norm_triton,
    param_error,
    unavailable_reason,
)

EPS = 1e-5


def reference(x, weight, bias, eps):
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    var = (x64 - mean).pow(2).mean(-1, keepdim=True)  # biased (population) variance
    return (x64 - mean) * torch.rsqrt(var + eps) * weight.double() + bias.double()


def make_inputs(shape, dtype, seed=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = (offset + torch.randn(shape, generator=gen)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    bias = (0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight, bias


def check(x, weight, bias, cfg):
    y = layer_norm_triton(x, weight, bias, EPS, **cfg)
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    ref = reference(x, weight, bias, EPS)
    assert_close_to(y, ref, x.dtype)


(test_matches_float64_reference, test_every_tunable_value_is_exercised,
 test_default_hidden_tiles) = reference_tests(check, make_inputs, triton_kernel)


@pytest.mark.parametrize("hidden", [1000, 1024])
def test_large_mean_small_variance(hidden):
    # In fp32, E[x^2] - E[x]^2 gets these variances (~1 around a mean of 1000) wrong by up to 20%,
    # i.e. outputs off by ~0.3; centring first leaves only x's own rounding (ulp(1000) = 6e-5).
    x, weight, bias = make_inputs((4, hidden), torch.float32, seed=3, offset=1000.0)
    cfg = {"block_size": 1024, "rows_per_program": 4, "threads_per_row": 32}
    y = layer_norm_triton(x, weight, bias, EPS, **cfg)
    assert (y.double() - reference(x, weight, bias, EPS)).abs().max().item() < 1e-3


@pytest.mark.parametrize("make_view", VIEWS)
def test_non_contiguous_input(make_view):
    base, _, _ = make_inputs((10, 200), torch.float32, seed=1)
    x = make_view(base)
    assert not x.is_contiguous()
    _, weight, bias = make_inputs((100,), torch.float32, seed=2)
    before = base.clone()
    check(x, weight, bias, {"block_size": 128, "rows_per_program": 4, "threads_per_row": 16})
    assert torch.equal(base, before)


def test_float32_parameters_with_bfloat16_input():
    x, _, _ = make_inputs((6, 40), torch.bfloat16, seed=5)
    _, weight, bias = make_inputs((40,), torch.float32, seed=6)
    check(x, weight, bias, {"block_size": 64, "rows_per_program": 4, "threads_per_row": 16})


def test_constant_row_gives_bias():
    x, weight, bias = make_inputs((4, 24), torch.float32, seed=7)
    x[1] = 3.0
    cfg = {"block_size": 32, "rows_per_program": 4, "threads_per_row": 8}
    y = layer_norm_triton(x, weight, bias, EPS, **cfg)
    torch.testing.assert_close(y[1], bias, rtol=0, atol=1e-6)


def test_param_error_and_bad_inputs():
    assert param_error((2048, 4096), 4096, 2, 64) is None
    assert "spill" in param_error((2048, 8192), 8192, 1, 64)
    assert "masked" in param_error((1, 4096), 4096, 2, 64)
    x, weight, bias = make_inputs((2, 1000), torch.float32)
    cfg = {"block_size": 1024, "rows_per_program": 2, "threads_per_row": 64}
    with pytest.raises(ValueError, match="parameter shape"):
        layer_norm_triton(x, weight, bias[:10], EPS, **cfg)
    with pytest.raises(ValueError, match="next power of two"):
        layer_norm_triton(x, weight, bias, EPS, **{**cfg, "block_size": 512})
    assert unavailable_reason("cpu") is None

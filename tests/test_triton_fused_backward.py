"""The fused Triton backwards of the Triton RMSNorm and LayerNorm, run on CPU tensors through
the Triton interpreter: dx, dweight (and dbias) against the float64 reference's autograd
gradients at awkward shapes and tiles (one row, odd widths, a ragged last program, several rows
per program), fp32 and bf16; torch.library.opcheck of their ops; the `backward` tunable, present
only with a backward pass."""

import os

# Triton reads this when kernels are decorated, so it must be set before the kernel module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from fusionlab.kernels.common.triton_tiles import _next_pow2
from fusionlab.kernels.layernorm import triton_backward as ln_triton_backward
from fusionlab.kernels.layernorm.spec import layer_norm_float64
from fusionlab.kernels.rmsnorm import triton_backward
from fusionlab.kernels.rmsnorm.spec import TOLERANCES, rms_norm_float64_with
from fusionlab.kernels.rmsnorm.triton_kernel import param_error
from fusionlab.numerics import DEFAULT
from fusionlab.registry import get_variant

EPS = 1e-6
# (shape, rows_per_program): one row; odd widths; a ragged last program; 3-D rows.
CASES = [((1, 7), 1), ((3, 7), 4), ((5, 33), 4), ((33, 128), 8), ((2, 3, 48), 4), ((4, 1000), 1)]


def _tile(shape: tuple[int, ...], rows_per_program: int) -> dict[str, int]:
    """The tile with the fewest threads per row that param_error accepts at `shape`."""
    block_size = _next_pow2(shape[-1])
    for threads_per_row in (2**i for i in range(11)):
        tile = {"block_size": block_size, "rows_per_program": rows_per_program,
                "threads_per_row": threads_per_row}
        if param_error(shape, **tile) is None:
            return tile
    raise AssertionError(f"no tile for {shape} with {rows_per_program} rows per program")


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x (away from mean 0), an upstream gradient, a weight far from ones, a bias far from 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) + 0.5
    grad = torch.randn(shape, generator=g)
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=g)
    bias = 0.5 * torch.randn(shape[-1], generator=g)
    return tuple(t.to(dtype) for t in (x, grad, weight, bias))


def _assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...],
                  dtype: torch.dtype) -> None:
    """One rounding of an fp32 result relative to each gradient's scale (dweight sums rows)."""
    tol = TOLERANCES[dtype]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        scale = w.abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=2 * tol.rtol, atol=2 * tol.atol * scale)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(("shape", "rows_per_program"), CASES, ids=str)
def test_fused_rmsnorm_backward_matches_float64_autograd(shape, rows_per_program, dtype):
    x, grad, weight, _ = _inputs(shape, dtype)
    tile = _tile(shape, rows_per_program)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    got = torch.autograd.grad(
        triton_backward.rms_norm_triton_fused_grad(*leaves, EPS, **tile), leaves, grad)
    wide = [t.double().requires_grad_() for t in (x, weight)]
    want = torch.autograd.grad(rms_norm_float64_with(*wide, EPS, DEFAULT), wide, grad.double())
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(("shape", "rows_per_program"), CASES, ids=str)
def test_fused_layernorm_backward_matches_float64_autograd(shape, rows_per_program, dtype):
    x, grad, weight, bias = _inputs(shape, dtype)
    tile = _tile(shape, rows_per_program)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    got = torch.autograd.grad(
        ln_triton_backward.layer_norm_triton_fused_grad(*leaves, EPS, **tile), leaves, grad)
    wide = [t.double().requires_grad_() for t in (x, weight, bias)]
    want = torch.autograd.grad(layer_norm_float64(*wide, EPS), wide, grad.double())
    _assert_close(got, want, dtype)


def test_the_ops_pass_opcheck():
    x, grad, weight, bias = _inputs((3, 7), torch.float32)
    tile = _tile((3, 7), 4)
    torch.library.opcheck(triton_backward.rms_norm_triton_backward, (grad, x, weight, EPS), tile)
    torch.library.opcheck(ln_triton_backward.layer_norm_triton_backward,
                          (grad, x, weight, bias, EPS), tile)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    torch.library.opcheck(triton_backward.rms_norm_triton_fused_grad, (*leaves[:2], EPS), tile)
    torch.library.opcheck(ln_triton_backward.layer_norm_triton_fused_grad, (*leaves, EPS), tile)


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_the_backward_tunable_is_swept_only_with_a_backward(op):
    variant = get_variant(op, "triton")
    forward = list(variant.for_pass(False).configurations())
    training = list(variant.for_pass(True).configurations())
    assert all("backward" not in params for params in forward)
    assert {params["backward"] for params in training} == {"torch-ops", "fused"}
    x, grad, weight, bias = _inputs((3, 7), torch.float32)
    leaves = [t.requires_grad_() for t in (x, weight, bias)][: 2 if op == "rmsnorm" else 3]
    for backward in ("torch-ops", "fused"):
        kernel = variant.factory("cpu", backward=backward, **_tile((3, 7), 4))
        assert torch.autograd.grad(kernel(*leaves, EPS), leaves, grad)[0].shape == (3, 7)
    with pytest.raises(ValueError, match="backward must be one of"):
        variant.factory("cpu", backward="fused-saved", **_tile((3, 7), 4))

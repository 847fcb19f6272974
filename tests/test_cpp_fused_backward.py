"""The fused C++ backward kernels of the C++ rmsnorm, layernorm, add_rmsnorm and add_layernorm,
recomputing the row statistics (`fused`) or, for rmsnorm and layernorm, reading those the forward
saved (`fused-saved`): their gradients against the float64 reference's autograd gradients at
awkward shapes in fp32 and bf16 (the add ops with both outputs' gradients used, or either alone),
any input layout, the saving forward's y bit for bit the plain forward's, the statistics in the
saved bytes, torch.library.opcheck of the new ops, the `backward` tunable that only passes with
a backward sweep, and a real backward sweep of add_rmsnorm that measures both backwards."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from helpers import sqlite_url

from fusionlab.errors import RegistrationError
from fusionlab.kernels.add_layernorm import cpu_backward as add_ln_backward
from fusionlab.kernels.add_layernorm.spec import add_layer_norm_float64
from fusionlab.kernels.add_rmsnorm import cpu_backward as add_rms_backward
from fusionlab.kernels.add_rmsnorm.spec import add_rms_norm_float64_with
from fusionlab.kernels.layernorm import cpu_backward as ln_backward
from fusionlab.kernels.layernorm import cpu_cpp as ln_forward
from fusionlab.kernels.rmsnorm import cpu_backward as rms_backward
from fusionlab.kernels.rmsnorm import cpu_cpp as rms_forward
from fusionlab.kernels.rmsnorm.spec import TOLERANCES, rms_norm_float64_with
from fusionlab.measure.pass_memory import pass_memory
from fusionlab.measure.passes import BACKWARD, PassCall, pass_spec
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.registry import get_op, get_variant, register_variant
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage

_UNAVAILABLE = rms_forward.unavailable_reason()
needs_cpp = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")
EPS = 1e-6
DTYPES = (torch.float32, torch.bfloat16)
# One row; odd widths below and around a vector block; rows that no chunk size divides; 3-D.
SHAPES = ((1, 7), (1, 4096), (3, 33), (67, 1000), (2, 3, 130))


@pytest.fixture(scope="module")
def loaded() -> None:
    if _UNAVAILABLE is None:
        rms_backward.load_extension()
        ln_backward.load_extension()
        add_rms_backward.load_extension()
        add_ln_backward.load_extension()


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0,
            mean: float = 0.0) -> tuple[torch.Tensor, ...]:
    """x (around `mean`), an upstream gradient, a weight far from ones and a bias far from 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) + mean
    grad = torch.randn(shape, generator=g)
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=g)
    bias = 0.5 * torch.randn(shape[-1], generator=g)
    return tuple(t.to(dtype) for t in (x, grad, weight, bias))


def _float64_grads(fn, grad: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    return list(torch.autograd.grad(fn(*leaves), leaves, grad.double()))


def _kernel_grads(fn, grad: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    return list(torch.autograd.grad(fn(*leaves), leaves, grad))


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    """One rounding of an fp32 result, relative to each gradient's scale (a weight's gradient is
    a sum over rows): twice the op's tolerance, as the sweep's gradient gate allows."""
    tol = TOLERANCES[dtype]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        scale = w.abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=2 * tol.rtol, atol=2 * tol.atol * scale)


RMS_FUSED = {"fused": rms_backward.rms_norm_cpp_fused_grad,
             "fused-saved": rms_backward.rms_norm_cpp_saved_stats}
LN_FUSED = {"fused": ln_backward.layer_norm_cpp_fused_grad,
            "fused-saved": ln_backward.layer_norm_cpp_saved_stats}


@needs_cpp
@pytest.mark.parametrize("backward", RMS_FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("numerics", [DEFAULT, Numerics("gemma", 1.0)], ids=["none", "gemma"])
def test_fused_rmsnorm_backward_matches_float64_autograd(loaded, numerics, shape, dtype,
                                                         backward):
    x, grad, weight, _ = _inputs(shape, dtype)
    fused = RMS_FUSED[backward]
    got = _kernel_grads(
        lambda x, w: fused(x, w, EPS, 16, numerics.casting, numerics.offset), grad, x, weight)
    want = _float64_grads(lambda x, w: rms_norm_float64_with(x, w, EPS, numerics), grad, x, weight)
    _assert_close(got, want, dtype)


@needs_cpp
@pytest.mark.parametrize("backward", LN_FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_layernorm_backward_matches_float64_autograd(loaded, shape, dtype, backward):
    """x has mean 20: the moments are taken from the centred rows, not from raw sums."""
    x, grad, weight, bias = _inputs(shape, dtype, mean=20.0)
    fused = LN_FUSED[backward]
    got = _kernel_grads(lambda x, w, b: fused(x, w, b, EPS, 16), grad, x, weight, bias)
    want = _float64_grads(
        lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS), grad, x,
        weight, bias)
    _assert_close(got, want, dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_layout_gives_the_contiguous_result(loaded, dtype):
    """A strided x and an expanded (stride-0) upstream gradient are read correctly."""
    x, _, weight, bias = _inputs((40, 130), dtype)
    wide = torch.zeros(40, 260, dtype=dtype)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    grad = torch.randn(1, 130).to(dtype).expand(40, 130)
    assert not strided.is_contiguous() and not grad.is_contiguous()
    rms = torch.ops.fusionlab.rms_norm_cpu_backward_fused
    ln = torch.ops.fusionlab.layer_norm_cpu_backward_fused
    for got, want in [
        (rms(grad, strided, weight, EPS, 0.0, 4), rms(grad.contiguous(), x, weight, EPS, 0.0, 4)),
        (ln(grad, strided, weight, bias, EPS, 4), ln(grad.contiguous(), x, weight, bias, EPS, 4)),
    ]:
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


@needs_cpp
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_saving_forwards_write_the_plain_forwards_y_bit_for_bit(loaded, shape, dtype):
    """Same row function, same y, at every casting mode, store kind, statistics and row group;
    the statistics are fp32, one per row, and are what the row's y was computed from."""
    x, _, weight, bias = _inputs(shape, dtype, mean=3.0)
    for casting, offset in (("none", 0.0), ("llama", 0.0), ("gemma", 1.0)):
        for store in ("plain", "stream"):
            args = (x, weight, EPS, 4, casting, offset, store)
            y, rstd = torch.ops.fusionlab.rms_norm_cpu_stats(*args)
            assert torch.equal(y, rms_forward.rms_norm_cpp_with(*args[:4], casting, offset,
                                                                store))
            assert rstd.dtype == torch.float32 and rstd.shape == shape[:-1]
            want = torch.rsqrt(x.float().square().mean(-1) + EPS)
            torch.testing.assert_close(rstd, want, rtol=1e-5, atol=0)
    for stats in ("welford", "shifted"):
        for row_group in (1, 4):
            args = (x, weight, bias, EPS, 2, "plain", stats, row_group)
            y, mean, rstd = torch.ops.fusionlab.layer_norm_cpu_stats(*args)
            assert torch.equal(y, ln_forward.layer_norm_cpp(*args))
            assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == shape[:-1]
            wide = x.double()
            torch.testing.assert_close(mean.double(), wide.mean(-1), rtol=1e-6, atol=1e-6)
            want = torch.rsqrt(wide.var(-1, unbiased=False) + EPS)
            torch.testing.assert_close(rstd.double(), want, rtol=1e-4, atol=0)


@needs_cpp
@pytest.mark.parametrize(("op", "stat_bytes"), [("rmsnorm", 4), ("layernorm", 8)])
def test_saved_bytes_include_the_statistics(loaded, op, stat_bytes):
    """The backward sweep's saved-tensor bytes: fused-saved keeps what fused keeps (x and the
    parameters) plus fp32 statistics for each row, nothing else."""
    shape = (6, 5, 128)
    spec = pass_spec(get_op(op), BACKWARD, shape, torch.float32)
    inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"), 3)
    saved = {}
    for backward in ("fused", "fused-saved"):
        kernel = get_variant(op, "cpp").factory("cpu", rows_per_task=4, backward=backward)
        call = PassCall(kernel, get_op(op), BACKWARD)
        saved[backward] = pass_memory(call, inputs, torch.device("cpu")).saved_bytes
    assert saved["fused-saved"] - saved["fused"] == stat_bytes * 30, saved


@needs_cpp
def test_saved_statistics_are_checked(loaded):
    x, grad, weight, bias = _inputs((4, 32), torch.float32)
    rstd = torch.ones(4)
    rms = torch.ops.fusionlab.rms_norm_cpu_backward_saved
    ln = torch.ops.fusionlab.layer_norm_cpu_backward_saved
    with pytest.raises(RuntimeError, match="rstd must be float32"):
        rms(grad, x, weight, rstd[:3], 0.0, 4)
    with pytest.raises(RuntimeError, match="rstd must be float32"):
        rms(grad, x, weight, rstd.double(), 0.0, 4)
    with pytest.raises(RuntimeError, match="mean and rstd must be float32"):
        ln(grad, x, weight, bias, rstd, rstd.half(), 4)


@needs_cpp
def test_bad_arguments_are_refused(loaded):
    x, grad, weight, _ = _inputs((4, 32), torch.float32)
    rms = torch.ops.fusionlab.rms_norm_cpu_backward_fused
    with pytest.raises(RuntimeError, match="grad_y must have x's shape"):
        rms(grad[:2], x, weight, EPS, 0.0, 4)
    with pytest.raises(RuntimeError, match="must share"):
        rms(grad.double(), x, weight, EPS, 0.0, 4)
    with pytest.raises(RuntimeError, match="rows_per_task"):
        rms(grad, x, weight, EPS, 0.0, 0)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_new_ops_pass_opcheck(loaded, dtype):
    x, grad, weight, bias = _inputs((3, 5, 100), dtype)
    ops = torch.ops.fusionlab
    torch.library.opcheck(ops.rms_norm_cpu_backward_fused.default, (grad, x, weight, EPS, 1.0, 2))
    torch.library.opcheck(ops.layer_norm_cpu_backward_fused.default,
                          (grad, x, weight, bias, EPS, 2))
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    torch.library.opcheck(ops.rms_norm_cpu_fused_grad.default, (*leaves[:2], EPS, 2))
    torch.library.opcheck(ops.layer_norm_cpu_fused_grad.default, (*leaves, EPS, 2))
    rstd = torch.rand(3, 5) + 0.5
    mean = torch.randn(3, 5)
    torch.library.opcheck(ops.rms_norm_cpu_backward_saved.default, (grad, x, weight, rstd, 1.0, 2))
    torch.library.opcheck(ops.layer_norm_cpu_backward_saved.default,
                          (grad, x, weight, bias, mean, rstd, 2))
    torch.library.opcheck(ops.rms_norm_cpu_stats.default, (*leaves[:2], EPS, 2, "gemma", 1.0))
    torch.library.opcheck(ops.layer_norm_cpu_stats.default, (*leaves, EPS, 2))


@needs_cpp
@pytest.mark.parametrize(("op", "args"), [
    ("rmsnorm", "xw"), ("layernorm", "xwb"), ("add_rmsnorm", "xrw"), ("add_layernorm", "xrwb"),
])
def test_both_backward_choices_agree_through_the_variant(loaded, op, args):
    """The `cpp` variant's tunable picks the backward; the forward is the same kernel. The add
    ops' outputs (y, residual_out) both get an upstream gradient."""
    variant = get_variant(op, "cpp")
    x, grad, weight, bias = _inputs((17, 96), torch.float32)
    residual, grad_sum = _inputs((17, 96), torch.float32, seed=1)[:2]
    tensors = {"x": x, "r": residual, "w": weight, "b": bias}
    results = {}
    for backward in variant.backward_tunables["backward"]:
        kernel = variant.factory("cpu", rows_per_task=4, backward=backward)
        leaves = [tensors[name].clone().requires_grad_() for name in args]
        outputs = kernel(*leaves, EPS)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grads = (grad, grad_sum)[:len(outputs)]
        results[backward] = (outputs, torch.autograd.grad(outputs, leaves, grads))
    y_ops, g_ops = results.pop("torch-ops")
    assert sorted(results) == (["fused", "fused-saved"] if op in ("rmsnorm", "layernorm")
                               else ["fused"])
    for y_fused, g_fused in results.values():
        for a, b in zip(y_ops, y_fused, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(g_ops, g_fused, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="backward must be one of"):
        variant.factory("cpu", rows_per_task=4, backward="bogus")


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm", "add_layernorm"])
def test_the_backward_tunable_is_swept_only_with_a_backward(op):
    variant = get_variant(op, "cpp")
    forward = list(variant.for_pass(False).configurations())
    training = list(variant.for_pass(True).configurations())
    assert all("backward" not in params for params in forward)
    saved = {"fused-saved"} if op in ("rmsnorm", "layernorm") else set()
    choices = {"torch-ops", "fused"} | saved
    assert {params["backward"] for params in training} == choices
    assert len(training) == len(choices) * len(forward)
    get_op("rmsnorm")  # the built-in ops are registered before the plugin-style one below
    with pytest.raises(RegistrationError, match="declares autograd"):
        register_variant("rmsnorm", "no-grad-tunable", devices=("cpu",), autograd=False,
                         backward_tunables={"backward": ("a", "b")})(lambda device_type: None)


def _add_inputs(shape: tuple[int, ...], dtype: torch.dtype,
                mean: float = 0.0) -> dict[str, torch.Tensor]:
    """x (around `mean`), residual, weight, bias and the upstream gradients of y and of
    residual_out (`grad_sum`)."""
    x, grad, weight, bias = _inputs(shape, dtype, seed=0, mean=mean)
    residual, grad_sum = _inputs(shape, dtype, seed=1)[:2]
    return {"x": x, "residual": residual, "weight": weight, "bias": bias, "grad": grad,
            "grad_sum": grad_sum}


def _pair_grads(fn, t: dict[str, torch.Tensor], names: str, used: str,
                float64: bool = False) -> list[torch.Tensor]:
    """Gradients of fn's inputs `names` (leaves) from the upstream gradients of the outputs in
    `used` ("y", "sum" or both)."""
    cast = (lambda v: v.detach().double()) if float64 else (lambda v: v.detach().clone())
    leaves = [cast(t[name]).requires_grad_() for name in names.split(",")]
    y, total = fn(*leaves)
    outputs, grads = [], []
    if "y" in used:
        outputs.append(y), grads.append(cast(t["grad"]))
    if "sum" in used:
        outputs.append(total), grads.append(cast(t["grad_sum"]))
    return list(torch.autograd.grad(outputs, leaves, grads, materialize_grads=True))


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("numerics", [DEFAULT, Numerics("gemma", 1.0), Numerics("llama", 0.0)],
                         ids=["none", "gemma", "llama"])
def test_fused_add_rmsnorm_backward_matches_float64_autograd(loaded, numerics, shape, dtype):
    """Both outputs' gradients used; "llama" and "gemma" round the sum before the norm."""
    t = _add_inputs(shape, dtype)
    got = _pair_grads(
        lambda x, r, w: add_rms_backward.add_rms_norm_cpp_fused_grad(
            x, r, w, EPS, 16, numerics.casting, numerics.offset), t, "x,residual,weight", "y,sum")
    want = _pair_grads(
        lambda x, r, w: add_rms_norm_float64_with(x, r, w, EPS, numerics, dtype), t,
        "x,residual,weight", "y,sum", float64=True)
    _assert_close(got, want, dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_layernorm_backward_matches_float64_autograd(loaded, shape, dtype):
    """Both outputs' gradients used; x has mean 20, so the moments must come from centred sums."""
    t = _add_inputs(shape, dtype, mean=20.0)
    names = "x,residual,weight,bias"
    got = _pair_grads(
        lambda x, r, w, b: add_ln_backward.add_layer_norm_cpp_fused_grad(x, r, w, b, EPS, 16), t,
        names, "y,sum")
    want = _pair_grads(lambda x, r, w, b: add_layer_norm_float64(x, r, w, b, EPS), t, names,
                       "y,sum", float64=True)
    _assert_close(got, want, dtype)


def _add_rms(x, r, w):
    return add_rms_backward.add_rms_norm_cpp_fused_grad(x, r, w, EPS, 2)


def _add_rms_float64(x, r, w):
    return add_rms_norm_float64_with(x, r, w, EPS, DEFAULT, torch.float32)


def _add_ln(x, r, w, b):
    return add_ln_backward.add_layer_norm_cpp_fused_grad(x, r, w, b, EPS, 2)


def _add_ln_float64(x, r, w, b):
    return add_layer_norm_float64(x, r, w, b, EPS)


_ADD_OPS = {
    "add_rmsnorm": ("x,residual,weight", _add_rms, _add_rms_float64),
    "add_layernorm": ("x,residual,weight,bias", _add_ln, _add_ln_float64),
}


@needs_cpp
@pytest.mark.parametrize("used", ["y", "sum"])
@pytest.mark.parametrize("op", ["add_rmsnorm", "add_layernorm"])
def test_fused_add_backward_with_one_output_used(loaded, op, used):
    """Only y's gradient: the norm's alone. Only residual_out's: dx = dresidual = that gradient
    exactly, and the weight (and bias) gradients are zero."""
    t = _add_inputs((5, 70), torch.float32)
    names, fn, ref = _ADD_OPS[op]
    got = _pair_grads(fn, t, names, used)
    _assert_close(got, _pair_grads(ref, t, names, used, float64=True), torch.float32)
    if used == "sum":
        assert torch.equal(got[0], t["grad_sum"]) and torch.equal(got[1], t["grad_sum"])
        assert all(not g.any() for g in got[2:])


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_backward_reads_any_layout(loaded, dtype):
    """A strided x and expanded (stride-0) upstream gradients give the contiguous result."""
    t = _add_inputs((40, 130), dtype)
    wide = torch.zeros(40, 260, dtype=dtype)
    wide[:, ::2] = t["x"]
    strided = wide[:, ::2]
    grad = t["grad"][:1].expand(40, 130)
    grad_sum = t["grad_sum"][:1].expand(40, 130)
    rms = torch.ops.fusionlab.add_rms_norm_cpu_backward_fused
    ln = torch.ops.fusionlab.add_layer_norm_cpu_backward_fused
    r, w, b = t["residual"], t["weight"], t["bias"]
    for got, want in [
        (rms(grad, grad_sum, strided, r, w, EPS, 1.0, True, 4),
         rms(grad.contiguous(), grad_sum.contiguous(), t["x"], r, w, EPS, 1.0, True, 4)),
        (ln(grad, grad_sum, strided, r, w, b, EPS, 4),
         ln(grad.contiguous(), grad_sum.contiguous(), t["x"], r, w, b, EPS, 4)),
    ]:
        for g, want_g in zip(got, want, strict=True):
            assert torch.equal(g, want_g)


@needs_cpp
def test_bad_add_backward_arguments_are_refused(loaded):
    t = _add_inputs((4, 32), torch.float32)
    rms = torch.ops.fusionlab.add_rms_norm_cpu_backward_fused
    x, r, w, g = t["x"], t["residual"], t["weight"], t["grad"]
    with pytest.raises(RuntimeError, match="must have x's shape"):
        rms(g, g[:2], x, r, w, EPS, 0.0, False, 4)
    with pytest.raises(RuntimeError, match="must have x's dtype"):
        rms(g, None, x, r.double(), w, EPS, 0.0, False, 4)
    with pytest.raises(RuntimeError, match="rows_per_task"):
        rms(g, None, x, r, w, EPS, 0.0, False, 0)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.fusionlab.add_layer_norm_cpu_backward_fused(g, None, x, r, w, w[:3], EPS, 4)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_new_add_ops_pass_opcheck(loaded, dtype):
    t = _add_inputs((3, 5, 100), dtype)
    ops = torch.ops.fusionlab
    g, gs, x, r, w, b = (t[k] for k in ("grad", "grad_sum", "x", "residual", "weight", "bias"))
    for grad_sum in (gs, None):
        torch.library.opcheck(ops.add_rms_norm_cpu_backward_fused.default,
                              (g, grad_sum, x, r, w, EPS, 1.0, True, 2))
        torch.library.opcheck(ops.add_layer_norm_cpu_backward_fused.default,
                              (g, grad_sum, x, r, w, b, EPS, 2))
    leaves = [v.clone().requires_grad_() for v in (x, r, w, b)]
    torch.library.opcheck(ops.add_rms_norm_cpu_fused_grad.default,
                          (*leaves[:3], EPS, 2, "gemma", 1.0))
    torch.library.opcheck(ops.add_layer_norm_cpu_fused_grad.default, (*leaves, EPS, 2))


@needs_cpp
def test_a_backward_sweep_of_add_rmsnorm_measures_the_fused_backward(tmp_path):
    """A real quick sweep of the backward pass decides its cell with both backwards measured and
    every record through the gradient gate."""
    storage = sqlite_url(tmp_path / "add.db")
    done = run_cli("sweep", "add_rmsnorm", "--pass", "backward", "--variants", "cpp",
                   "--shapes", "64x256", "--dtypes", "float32", "--quick", "--no-screen",
                   "--storage", storage, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (cell,) = load_cells(open_storage(storage, must_exist=True, read_only=True), "add_rmsnorm")
    assert cell.cell.pass_name == "backward" and cell.verdicts, cell.cell.label
    assert all(record.passed for record in cell.records), [
        (r.params, r.message) for r in cell.records if not r.passed]
    assert {r.params.get("backward") for r in cell.records} == {"torch-ops", "fused"}

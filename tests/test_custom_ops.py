"""The hand-written kernels as PyTorch custom ops: fake kernels (torch.compile traces a module that
calls them with no graph break), torch.library.opcheck, and their autograd (gradcheck of the
backward formula in float64; the ops' gradients against the float64 reference's in fp32/bf16).
Triton ops run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusionlab.kernels import norm_grads
from fusionlab.kernels.add_layernorm import cpu_cpp as add_ln_cpp
from fusionlab.kernels.add_layernorm.spec import add_layer_norm_float64
from fusionlab.kernels.add_rmsnorm import cpu_cpp as add_cpp
from fusionlab.kernels.add_rmsnorm.spec import add_rms_norm_float64_with
from fusionlab.kernels.layernorm import cpu_cpp as ln_cpp
from fusionlab.kernels.rmsnorm import cpu_cpp as rms_cpp
from fusionlab.kernels.rmsnorm.spec import TOLERANCES, rms_norm_float64_with
from fusionlab.numerics import Numerics
from fusionlab.registry import get_variant

_UNAVAILABLE = rms_cpp.unavailable_reason()
needs_cpp = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")
EPS = 1e-6
SHAPE = (3, 5, 100)  # 3-D, and a hidden size that is not a multiple of the vector width
DTYPES = (torch.float32, torch.bfloat16)
MODES = (Numerics(), Numerics("llama"), Numerics("gemma", 1.0))
TRITON = {"block_size": 128, "rows_per_program": 2, "threads_per_row": 16}


def _inputs(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """x-shaped tensors, then a weight far from ones and a bias far from zeros."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(SHAPE, generator=g) * (1 + i) for i in range(n)]
    weight = 1 + 0.5 * torch.randn(SHAPE[-1], generator=g)
    bias = 0.5 * torch.randn(SHAPE[-1], generator=g)
    return [t.to(dtype) for t in (*tensors, weight, bias)]


@pytest.fixture(scope="module")
def loaded() -> None:
    if _UNAVAILABLE is None:
        for module in (rms_cpp, ln_cpp, add_cpp, add_ln_cpp):
            module.load_extension()


def _variant_kernel(op: str, name: str, numerics: Numerics | None = None, **params) -> Callable:
    extra = {} if numerics is None else {"numerics": numerics}
    return get_variant(op, name).factory("cpu", **extra, **params)


# --- the C++ ops: opcheck, and torch.compile with no graph break ---------------------------------

CPP_OPCHECK = [
    ("rms_norm_cpu", 1, ()),
    ("rms_norm_cpu", 1, ("llama", 0.0)),
    ("rms_norm_cpu", 1, ("gemma", 1.0)),
    ("layer_norm_cpu", 1, "bias"),
    ("add_rms_norm_cpu", 2, ()),
    ("add_rms_norm_cpu", 2, ("llama", 0.5)),
    ("add_rms_norm_cpu_", 2, ()),
    ("add_layer_norm_cpu", 2, "bias"),
]


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "n_x", "extra"), CPP_OPCHECK)
def test_cpp_ops_pass_opcheck(loaded, name, n_x, extra, dtype):
    *xs, weight, bias = _inputs(n_x, dtype)
    inplace = name.endswith("_")
    tensors = [*xs, weight, bias] if extra == "bias" else [*xs, weight]
    if not inplace:  # out-of-place ops have autograd: opcheck checks its registration too
        tensors = [t.requires_grad_() for t in tensors]
    args = (*tensors, EPS, 4, *(() if extra == "bias" else extra))
    torch.library.opcheck(getattr(torch.ops.fusionlab, name).default, args)


class _Block(torch.nn.Module):
    """A small module around one kernel call, with ATen ops before and after it."""

    def __init__(self, kernel: Callable, n_inputs: int) -> None:
        super().__init__()
        self.kernel, self.n_inputs = kernel, n_inputs

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        scaled = [t * 1.5 for t in tensors[: self.n_inputs]]
        outputs = self.kernel(*scaled, *tensors[self.n_inputs :], EPS)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum(o.float().sum(-1) for o in outputs)


CPP_VARIANTS = [
    ("rmsnorm", "cpp", 1, False, None),
    ("rmsnorm", "cpp", 1, False, Numerics("llama")),
    ("rmsnorm", "cpp", 1, False, Numerics("gemma", 1.0)),
    ("layernorm", "cpp", 1, True, None),
    ("add_rmsnorm", "cpp", 2, False, None),
    ("add_rmsnorm", "cpp", 2, False, Numerics("llama")),
    ("add_rmsnorm", "cpp-inplace", 2, False, None),
    ("add_rmsnorm", "cpp-inplace", 2, False, Numerics("gemma", 1.0)),
    ("add_layernorm", "cpp", 2, True, None),
]


@needs_cpp
@pytest.mark.parametrize(("op", "name", "n_x", "has_bias", "numerics"), CPP_VARIANTS)
def test_compiling_a_module_that_calls_a_cpp_op_has_no_graph_break(
    op, name, n_x, has_bias, numerics
):
    *xs, weight, bias = _inputs(n_x)
    tensors = (*xs, weight, *((bias,) if has_bias else ()))
    block = _Block(_variant_kernel(op, name, numerics, rows_per_task=4), n_x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*tensors)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    ops_in_graph = {
        str(node.target)
        for graph in explained.graphs
        for node in graph.graph.nodes
        if node.op == "call_function"
    }
    assert any(target.startswith("fusionlab.") for target in ops_in_graph), ops_in_graph
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(*tensors), block(*tensors))


# --- fake kernels ---------------------------------------------------------------------------------

TRITON_OPS = ["rms_norm_triton", "layer_norm_triton", "add_rms_norm_triton", "add_rms_norm_triton_",
              "add_layer_norm_triton"]


def _triton_ops() -> dict[str, tuple[Callable, int, bool]]:
    pytest.importorskip("triton")
    from fusionlab.kernels.add_layernorm import triton_kernel as add_ln_triton
    from fusionlab.kernels.add_rmsnorm import triton_kernel as add_triton
    from fusionlab.kernels.layernorm import triton_kernel as ln_triton
    from fusionlab.kernels.rmsnorm import triton_kernel as rms_triton

    return {
        "rms_norm_triton": (rms_triton.rms_norm_triton, 1, False),
        "layer_norm_triton": (ln_triton.layer_norm_triton, 1, True),
        "add_rms_norm_triton": (add_triton.add_rms_norm_triton, 2, False),
        "add_rms_norm_triton_": (add_triton.add_rms_norm_triton_, 2, False),
        "add_layer_norm_triton": (add_ln_triton.add_layer_norm_triton, 2, True),
    }


@pytest.mark.parametrize("name", TRITON_OPS)
def test_triton_fake_kernels_give_the_real_outputs_shape_dtype_and_device(name):
    fn, n_x, has_bias = _triton_ops()[name]
    *xs, weight, bias = _inputs(n_x, torch.bfloat16)
    tensors = (*xs, weight, *((bias,) if has_bias else ()))
    real = fn(*[t.clone() for t in tensors], EPS, **TRITON)
    with FakeTensorMode() as mode:
        fake = fn(*[mode.from_tensor(t) for t in tensors], EPS, **TRITON)
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(fake) == len(real)
    for f, r in zip(fake, real, strict=True):
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


@pytest.mark.parametrize("name", TRITON_OPS)
def test_triton_ops_pass_opcheck_in_the_interpreter(name):
    _fn, n_x, has_bias = _triton_ops()[name]
    op = getattr(torch.ops.fusionlab, name).default
    *xs, weight, bias = _inputs(n_x)
    tensors = [*xs, weight, *((bias,) if has_bias else ())]
    if not name.endswith("_"):
        tensors = [t.requires_grad_() for t in tensors]
    torch.library.opcheck(op, (*tensors, EPS), TRITON)


@pytest.mark.parametrize("name", ["rms_norm_triton", "add_rms_norm_triton_",
                                  "add_layer_norm_triton"])
def test_compiling_a_module_that_calls_a_triton_op_has_no_graph_break(name):
    fn, n_x, has_bias = _triton_ops()[name]
    *xs, weight, bias = _inputs(n_x)
    block = _Block(functools.partial(fn, **TRITON), n_x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*xs, weight, *((bias,) if has_bias else ()))
    assert explained.graph_break_count == 0, explained.break_reasons


# --- autograd ------------------------------------------------------------------------------------

class _RMSNormFloat64(torch.autograd.Function):
    """Forward: the float64 reference. Backward: the kernels' formula (norm_grads)."""

    @staticmethod
    def forward(ctx, x, weight, offset):
        ctx.save_for_backward(x, weight)
        ctx.offset = offset
        return rms_norm_float64_with(x, weight, EPS, Numerics("none", offset))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        return (*norm_grads.rms_norm_grads(grad_y, x, weight, EPS, ctx.offset), None)


class _LayerNormFloat64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, EPS)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        return norm_grads.layer_norm_grads(grad_y, x, weight, EPS)


class _AddRMSNormFloat64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight):
        ctx.save_for_backward(x, residual, weight)
        return add_rms_norm_float64_with(x, residual, weight, EPS, Numerics("none", 0.5))

    @staticmethod
    def backward(ctx, grad_y, grad_residual_out):
        x, residual, weight = ctx.saved_tensors
        grad_total, grad_weight = norm_grads.add_rms_norm_grads(
            grad_y, grad_residual_out, x, residual, weight, EPS, 0.5
        )
        return grad_total, grad_total, grad_weight


class _AddLayerNormFloat64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias):
        ctx.save_for_backward(x, residual, weight)
        return add_layer_norm_float64(x, residual, weight, bias, EPS)

    @staticmethod
    def backward(ctx, grad_y, grad_residual_out):
        x, residual, weight = ctx.saved_tensors
        grad_total, grad_weight, grad_bias = norm_grads.add_layer_norm_grads(
            grad_y, grad_residual_out, x, residual, weight, EPS
        )
        return grad_total, grad_total, grad_weight, grad_bias


@pytest.mark.parametrize(
    ("function", "n_tensors", "extra"),
    [(_RMSNormFloat64, 2, (0.0,)), (_RMSNormFloat64, 2, (1.0,)), (_LayerNormFloat64, 3, ()),
     (_AddRMSNormFloat64, 3, ()), (_AddLayerNormFloat64, 4, ())],
)
def test_backward_formulas_pass_gradcheck_in_float64(function, n_tensors, extra):
    g = torch.Generator().manual_seed(1)
    shape = (3, 16)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n_tensors - 1)]
    tensors.append(1 + 0.5 * torch.randn(shape[-1], generator=g, dtype=torch.float64))
    if function is _LayerNormFloat64:  # x, weight, bias
        tensors = [tensors[0], tensors[1][0], tensors[2]]
    if function is _AddLayerNormFloat64:  # x, residual (mean 3), weight, bias
        tensors = [tensors[0], tensors[1] + 3.0, tensors[2][0], tensors[3]]
    tensors = [t.requires_grad_() for t in tensors]
    assert torch.autograd.gradcheck(lambda *t: function.apply(*t, *extra), tensors)


def _grads(fn: Callable, tensors: list[torch.Tensor], seed: int = 2) -> list[torch.Tensor]:
    """Gradients of sum(outputs * fixed random weights) with respect to `tensors`."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
               for o in outputs)
    return list(torch.autograd.grad(loss, leaves))


def _assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype) -> None:
    # Each gradient is one rounding of an fp32 result (plus fp32 accumulation): the op's own
    # tolerance, with atol relative to the gradient's scale (weight gradients sum over rows).
    tol = TOLERANCES[dtype]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.double(), w, rtol=tol.rtol, atol=tol.atol * scale)


def _rms_ref(numerics: Numerics) -> Callable:
    return lambda x, w: rms_norm_float64_with(x, w, EPS, numerics, x.dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", MODES, ids=lambda n: f"{n.casting}-{n.offset}")
def test_cpp_rmsnorm_gradients_match_the_float64_reference(loaded, numerics, dtype):
    x, weight, _ = _inputs(1, dtype)
    kernel = _variant_kernel("rmsnorm", "cpp", numerics, rows_per_task=4)
    got = _grads(lambda x, w: kernel(x, w, EPS), [x, weight])
    want = _grads(lambda x, w: rms_norm_float64_with(x, w, EPS, numerics),
                  [x.double(), weight.double()])
    _assert_grads_close(got, want, dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", MODES, ids=lambda n: f"{n.casting}-{n.offset}")
def test_cpp_add_rmsnorm_gradients_match_the_float64_reference(loaded, numerics, dtype):
    x, residual, weight, _ = _inputs(2, dtype)
    kernel = _variant_kernel("add_rmsnorm", "cpp", numerics, rows_per_task=4)
    got = _grads(lambda x, r, w: kernel(x, r, w, EPS), [x, residual, weight])

    want = _grads(lambda x, r, w: add_rms_norm_float64_with(x, r, w, EPS, numerics, dtype),
                  [x.double(), residual.double(), weight.double()])
    _assert_grads_close(got, want, dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_layernorm_gradients_match_the_float64_reference(loaded, dtype):
    x, weight, bias = _inputs(1, dtype)
    kernel = _variant_kernel("layernorm", "cpp", rows_per_task=4)
    got = _grads(lambda x, w, b: kernel(x, w, b, EPS), [x, weight, bias])
    want = _grads(lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS),
                  [x.double(), weight.double(), bias.double()])
    _assert_grads_close(got, want, dtype)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_add_layernorm_gradients_match_the_float64_reference(loaded, dtype):
    x, residual, weight, bias = _inputs(2, dtype)
    kernel = _variant_kernel("add_layernorm", "cpp", rows_per_task=4)
    got = _grads(lambda x, r, w, b: kernel(x, r, w, b, EPS), [x, residual, weight, bias])
    want = _grads(lambda x, r, w, b: add_layer_norm_float64(x, r, w, b, EPS),
                  [x.double(), residual.double(), weight.double(), bias.double()])
    _assert_grads_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["rms_norm_triton", "layer_norm_triton", "add_rms_norm_triton",
                                  "add_layer_norm_triton"])
def test_triton_gradients_match_the_float64_reference(name, dtype):
    fn, n_x, has_bias = _triton_ops()[name]
    *xs, weight, bias = _inputs(n_x, dtype)
    tensors = [*xs, weight, *((bias,) if has_bias else ())]
    got = _grads(lambda *t: fn(*t, EPS, **TRITON), tensors)
    references = {
        "rms_norm_triton": _rms_ref(Numerics()),
        "layer_norm_triton": lambda x, w, b: torch.nn.functional.layer_norm(
            x, x.shape[-1:], w, b, EPS),
        "add_rms_norm_triton": lambda x, r, w: add_rms_norm_float64_with(x, r, w, EPS, Numerics()),
        "add_layer_norm_triton": lambda x, r, w, b: add_layer_norm_float64(x, r, w, b, EPS),
    }
    want = _grads(references[name], [t.double() for t in tensors])
    _assert_grads_close(got, want, dtype)


@needs_cpp
def test_in_place_variants_declare_no_autograd_and_the_registry_refuses_one_that_does():
    from fusionlab.errors import RegistrationError
    from fusionlab.registry import register_variant

    for op, name in [("add_rmsnorm", "cpp-inplace"), ("add_rmsnorm", "triton-inplace"),
                     ("add_rmsnorm", "builtin-inplace")]:
        assert get_variant(op, name).autograd is False
    with pytest.raises(RegistrationError, match="in-place variant cannot declare autograd"):
        register_variant("add_rmsnorm", "bad-inplace", devices=("cpu",), autograd=True,
                         inplace={"y": "x"})(lambda device_type: None)


@needs_cpp
@pytest.mark.parametrize(
    "op_name", ["rms_norm_cpu", "layer_norm_cpu", "add_rms_norm_cpu", "add_layer_norm_cpu"]
)
def test_cpp_autograd_kernels_are_cpp_so_inference_calls_run_no_python(loaded, op_name):
    """The Autograd kernel is registered from the C++ source (a Python one would be entered on
    every call, gradients or not), and a call without gradients records no graph."""
    dump = torch._C._dispatch_dump(f"fusionlab::{op_name}")
    autograd_lines = [line for line in dump.splitlines() if line.startswith("Autograd")]
    assert autograd_lines and all(".cpp" in line for line in autograd_lines), dump
    n_x = 2 if op_name.startswith("add") else 1
    *xs, weight, bias = _inputs(n_x)
    tensors = (*xs, weight, *((bias,) if "layer" in op_name else ()))
    outputs = getattr(torch.ops.fusionlab, op_name).default(*tensors, EPS, 4)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert all(o.grad_fn is None for o in outputs)


@needs_cpp
@pytest.mark.parametrize("numerics", MODES, ids=lambda n: n.casting)
def test_a_compiled_training_step_through_the_cpp_ops_matches_eager(loaded, numerics):
    """torch.compile of forward + backward through rmsnorm and add_rmsnorm C++ ops: one graph,
    and the same gradients as eager."""
    rms = _variant_kernel("rmsnorm", "cpp", numerics, rows_per_task=4)
    add = _variant_kernel("add_rmsnorm", "cpp", numerics, rows_per_task=4)

    def step(x, residual, w1, w2):
        y, total = add(x, residual, w1, EPS)
        return (rms(y * 2, w2, EPS).float().square().sum() + total.float().sum())

    x, residual, w1, _ = _inputs(2)
    w2 = w1.flip(0)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, residual, w1, w2)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = _grads(step, [x, residual, w1, w2])
    compiled = _grads(torch.compile(step, fullgraph=True), [x, residual, w1, w2])
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)

"""Casting modes (fusionlab/numerics.py): every variant that declares a mode matches the float64
reference of that mode and the transformers module it models (LlamaRMSNorm, GemmaRMSNorm), in
fp32 and bf16; the sweep path (no numerics) is unchanged."""

from __future__ import annotations

import pytest
import torch

from fusionlab.errors import UserError
from fusionlab.kernels.add_rmsnorm import spec as add_spec
from fusionlab.kernels.rmsnorm import cpu_cpp
from fusionlab.kernels.rmsnorm import spec as rms_spec
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.registry import get_variant, variants_of

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

CPU = torch.device("cpu")
SHAPE = (2, 9, 200)  # 3-D; 200 is not a multiple of the vector width, so tails run too
DTYPES = (torch.float32, torch.bfloat16)
LLAMA, GEMMA = Numerics("llama"), Numerics("gemma", 1.0)
MODES = (DEFAULT, LLAMA, GEMMA, Numerics("none", 0.5), Numerics("llama", 1.0))
_NO_CPP = cpu_cpp.unavailable_reason()


def _params(op: str, name: str) -> dict:
    """The first configuration of a variant's tunables (compiled: default mode, static)."""
    variant = get_variant(op, name)
    return next(variant.configurations()) if variant.tunables else {}


def _kernels(op: str, numerics: Numerics) -> list[str]:
    """fusionlab's own variants of `op` that run on this CPU and support `numerics` (plugins an
    earlier test loaded into this process, cheating ones included, are not under test here)."""
    return [name for name, v in variants_of(op).items()
            if v.factory.__module__.startswith("fusionlab.kernels.")
            and v.supports(numerics) and v.unavailable_reason("cpu") is None]


def _kernel(op: str, name: str, numerics: Numerics):
    """As the Dispatcher builds it: `numerics=` only when it differs from the default."""
    extra = {} if numerics == DEFAULT else {"numerics": numerics}
    return get_variant(op, name).factory("cpu", **extra, **_params(op, name))


def _call(op: str, name: str, numerics: Numerics, inputs: tuple) -> tuple[torch.Tensor, ...]:
    """The variant's outputs on copies of `inputs` (in-place variants write into theirs)."""
    copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    outputs = _kernel(op, name, numerics)(*copies)
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _hf_module(numerics: Numerics, weight: torch.Tensor, eps: float) -> torch.nn.Module:
    module_type = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm}[numerics.casting]
    module = module_type(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def _assert_within_tolerance(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = rms_spec.TOLERANCES[dtype]
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=tol.rtol, atol=tol.atol)


def test_numerics_rejects_an_unknown_casting_mode():
    with pytest.raises(UserError, match="unknown casting mode 'fp8'"):
        Numerics("fp8")


def test_the_none_reference_is_the_sweep_reference():
    inputs = rms_spec.make_inputs(SHAPE, torch.bfloat16, CPU, 3)
    assert torch.equal(rms_spec.reference_with(inputs, DEFAULT)[0], rms_spec.reference(inputs)[0])
    inputs = add_spec.make_inputs(SHAPE, torch.bfloat16, CPU, 3)
    for got, want in zip(add_spec.reference_with(inputs, DEFAULT), add_spec.reference(inputs),
                         strict=True):
        assert torch.equal(got, want)


def test_the_llama_reference_rounds_where_llama_does():
    """In bf16 the llama reference differs from the none reference by the rounding of x_normed."""
    inputs = rms_spec.make_inputs(SHAPE, torch.bfloat16, CPU, 3)
    (llama,), (none,) = rms_spec.reference_with(inputs, LLAMA), rms_spec.reference(inputs)
    x, weight, eps = inputs
    normed = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + eps)
    assert torch.equal(llama, normed.to(torch.bfloat16).double() * weight.double())
    assert not torch.equal(llama, none)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", MODES, ids=lambda n: f"{n.casting}-{n.offset}")
@pytest.mark.parametrize("op", ["rmsnorm", "add_rmsnorm"])
def test_every_declaring_variant_matches_its_modes_float64_reference(op, numerics, dtype):
    spec = rms_spec if op == "rmsnorm" else add_spec
    names = _kernels(op, numerics)
    assert {"naive", "compiled"} <= set(names)
    if _NO_CPP is None:
        assert "cpp" in names
    for name in names:
        torch._dynamo.reset()
        inputs = spec.make_inputs(SHAPE, dtype, CPU, 5)
        want = spec.reference_with(inputs, numerics)
        got = _call(op, name, numerics, inputs)
        for g, w in zip(got, want, strict=True):
            _assert_within_tolerance(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numerics", [LLAMA, GEMMA], ids=["llama", "gemma"])
@pytest.mark.parametrize("op", ["rmsnorm", "add_rmsnorm"])
def test_every_declaring_variant_matches_the_transformers_module(op, numerics, dtype):
    """Against LlamaRMSNorm / GemmaRMSNorm built with the same random weight (for add_rmsnorm,
    the module applied to the model's own bf16/fp32 sum `residual + x`). In bf16 the variant in
    the module's mode agrees almost bit for bit (<1% of elements differ, by one rounding step);
    the same kernel in casting "none" disagrees on far more, so the mode is what makes it match."""
    spec = rms_spec if op == "rmsnorm" else add_spec
    inputs = spec.make_inputs(SHAPE, dtype, CPU, 7)
    *tensors, weight, eps = inputs
    hf_input = tensors[0] if op == "rmsnorm" else tensors[1] + tensors[0]
    with torch.no_grad():
        want = _hf_module(numerics, weight, eps)(hf_input)
    for name in _kernels(op, numerics):
        torch._dynamo.reset()
        got = _call(op, name, numerics, inputs)
        y = got[0]
        _assert_within_tolerance(y, want, dtype)
        if op == "add_rmsnorm":
            assert torch.equal(got[1], hf_input)  # the residual stream the model carries on
        if dtype == torch.bfloat16:
            differs = (y != want).float().mean().item()
            assert differs < 0.01, (name, differs)


@pytest.mark.skipif(_NO_CPP is not None, reason=f"{_NO_CPP}")
@pytest.mark.parametrize("op", ["rmsnorm", "add_rmsnorm"])
def test_the_llama_mode_is_what_makes_the_cpp_kernel_match_llama(op):
    """The same kernel in casting "none" differs from LlamaRMSNorm on many bf16 elements."""
    spec = rms_spec if op == "rmsnorm" else add_spec
    inputs = spec.make_inputs(SHAPE, torch.bfloat16, CPU, 7)
    *tensors, weight, eps = inputs
    hf_input = tensors[0] if op == "rmsnorm" else tensors[1] + tensors[0]
    with torch.no_grad():
        want = _hf_module(LLAMA, weight, eps)(hf_input)
    llama = _call(op, "cpp", LLAMA, inputs)[0]
    none = _call(op, "cpp", DEFAULT, inputs)[0]
    assert (llama != want).float().mean().item() < 0.01
    assert (none != want).float().mean().item() > 0.05


def test_the_naive_sweep_chain_already_rounds_like_llama():
    """The seed's naive chain (what `naive` and `compiled` time in a sweep) rounds x_normed before
    the weight multiply: in bf16 it is LlamaRMSNorm bit for bit, and within the "none" tolerance."""
    from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

    x, weight, eps = rms_spec.make_inputs(SHAPE, torch.bfloat16, CPU, 11)
    with torch.no_grad():
        assert torch.equal(naive_rmsnorm(x, weight, eps), _hf_module(LLAMA, weight, eps)(x))


def test_variants_declare_the_modes_they_implement():
    for op in ("rmsnorm", "add_rmsnorm"):
        for name in ("naive", "compiled", "cpp"):
            assert get_variant(op, name).numerics == ("none", "llama", "gemma")
        assert get_variant(op, "builtin").numerics == ("none", "gemma")
    assert get_variant("add_rmsnorm", "cpp-inplace").numerics == ("none", "llama", "gemma")
    for name in ("triton", "nki"):
        assert get_variant("rmsnorm", name).numerics == ("none",)
    builtin_inplace = get_variant("add_rmsnorm", "builtin-inplace")
    assert builtin_inplace.supports(DEFAULT)
    assert not builtin_inplace.supports(Numerics("none", 1.0))  # no offset without numerics=
    assert get_variant("rmsnorm", "builtin").supports(Numerics("none", 1.0))
    assert not get_variant("rmsnorm", "builtin").supports(LLAMA)
    with pytest.raises(ValueError, match="casting 'llama'"):
        get_variant("rmsnorm", "builtin").factory("cpu", numerics=LLAMA)


@pytest.mark.skipif(_NO_CPP is not None, reason=f"{_NO_CPP}")
@pytest.mark.parametrize("numerics", [LLAMA, GEMMA], ids=["llama", "gemma"])
def test_cpp_inplace_writes_the_modes_results_into_its_inputs(numerics):
    inputs = add_spec.make_inputs(SHAPE, torch.bfloat16, CPU, 9)
    x, residual, weight, eps = inputs
    want = _kernel("add_rmsnorm", "cpp", numerics)(x, residual, weight, eps)
    x_in, residual_in = x.clone(), residual.clone()
    got = _kernel("add_rmsnorm", "cpp-inplace", numerics)(x_in, residual_in, weight, eps)
    assert got[0] is x_in and got[1] is residual_in
    assert torch.equal(x_in, want[0]) and torch.equal(residual_in, want[1])


@pytest.mark.skipif(_NO_CPP is not None, reason=f"{_NO_CPP}")
def test_the_sweep_path_is_unchanged():
    """Without numerics the factories return the very kernels the sweep always timed."""
    from fusionlab.kernels.add_rmsnorm import cpu_cpp as add_cpp
    from fusionlab.kernels.rmsnorm.framework import builtin_rmsnorm, naive_rmsnorm

    assert get_variant("rmsnorm", "naive").factory("cpu") is naive_rmsnorm
    assert get_variant("rmsnorm", "builtin").factory("cpu") is builtin_rmsnorm
    cpp = get_variant("rmsnorm", "cpp").factory("cpu", rows_per_task=4)
    assert cpp.func is cpu_cpp.rms_norm_cpp and cpp.keywords == {"rows_per_task": 4}
    add = get_variant("add_rmsnorm", "cpp").factory("cpu", rows_per_task=4)
    assert add.func is add_cpp.add_rms_norm_cpp


def _activations(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows like a model's activations: scales over orders of magnitude, a few outlier channels."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator)
    x *= torch.exp(2 * torch.randn(rows, 1, generator=generator))
    x[:, torch.randint(0, hidden, (max(hidden // 64, 1),), generator=generator)] *= 20
    return x.clamp(-1e4, 1e4).to(dtype)  # finite in float16


@pytest.mark.skipif(_NO_CPP is not None, reason=f"{_NO_CPP}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numerics", [LLAMA, GEMMA], ids=["llama", "gemma"])
@pytest.mark.parametrize("op", ["rmsnorm", "add_rmsnorm"])
def test_cpp_in_a_modules_numerics_equals_the_module_bit_for_bit(op, numerics, dtype):
    """The C++ kernels sum the squares in ATen's order in a module's numerics
    (kernels/rmsnorm/csrc/torch_order_sum.h), so their outputs equal LlamaRMSNorm's and
    GemmaRMSNorm's bit for bit, in fp32 too, at widths below, at and around the vector widths
    (the scalar path, tails, the cascade's levels) — in and out of place."""
    for hidden in (1, 5, 8, 9, 100, 896, 4099):
        rows = max(4, (1 << 16) // hidden)
        x = _activations(rows, hidden, dtype, hidden)
        weight = (1 + 0.1 * _activations(1, hidden, torch.float32, 1)[0]).to(dtype)
        if op == "rmsnorm":
            inputs, hf_input = (x, weight, 1e-6), x
        else:
            residual = 3 * _activations(rows, hidden, dtype, 2)
            inputs, hf_input = (x, residual, weight, 1e-6), residual + x
        with torch.no_grad():
            want = _hf_module(numerics, weight, 1e-6)(hf_input)
        names = ("cpp",) if op == "rmsnorm" else ("cpp", "cpp-inplace")
        for name in names:
            got = _call(op, name, numerics, inputs)
            assert torch.equal(got[0], want), (name, hidden, int((got[0] != want).sum()))
            if op == "add_rmsnorm":
                assert torch.equal(got[1], hf_input), (name, hidden)

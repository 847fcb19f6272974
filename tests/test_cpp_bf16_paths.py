"""The C++ RMSNorm and add + RMSNorm kernels' row paths (kernels/cpu_store.py): one or two passes
over each row, a parallel grain by bytes (LayerNorm's too), plain or streaming stores, against
float64 at awkward shapes in fp32 and bf16, in and out of place; the one-pass rows bit for bit the
two-pass ones in every casting mode; bad choices refused; the same paths in a build with no vector
ISA."""

import itertools

import pytest
import torch
from helpers import run_in_scalar_build

from fusionlab.kernels import cpp_build, cpu_store
from fusionlab.kernels.add_rmsnorm import cpu_cpp as add_rms
from fusionlab.kernels.layernorm import cpu_cpp as layer
from fusionlab.kernels.rmsnorm import cpu_cpp as rms

_UNAVAILABLE = cpp_build.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")

EPS = 1e-6
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-8 + 1e-5, 1e-5)}
# 1 row; widths of 1, below one vector, not a multiple of it; one streamable (64 x 4096).
SHAPES = ((1, 4097), (3, 1), (2, 7), (5, 33), (64, 4096))
DTYPES = (torch.float32, torch.bfloat16)
# (passes, task_bytes): both passes, the grain by rows alone, by 64 KiB, and one task for all.
PATHS = tuple(itertools.product(cpu_store.PASSES_CHOICES, (0, 1 << 16, 1 << 40)))


def _inputs(shape, dtype, seed=0, view=lambda t: t):
    """x and residual (seen through `view`) and a weight of the viewed width."""
    g = torch.Generator().manual_seed(seed)
    x, r = (view(torch.randn(shape, generator=g).mul_(3).add_(1).to(dtype)) for _ in range(2))
    return x, r, torch.randn(x.shape[-1], generator=g).to(dtype)


def _rms64(s, w):
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w


def _check(out, expected):
    rtol, atol = TOL[out.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


def check_paths(shape, dtype, passes, task_bytes, view=lambda t: t):
    """Both ops, in and out of place, with every store kind that applies, against float64."""
    x, r, w = _inputs(shape, dtype, view=view)
    x64, r64, w64 = x.double(), r.double(), w.double()
    stores = [s for s in ("plain", "stream") if cpu_store.store_error(x.shape, s) is None]
    for store in stores:
        _check(rms.rms_norm_cpp(x, w, EPS, 1, store, passes, task_bytes), _rms64(x64, w64))
        out, res = add_rms.add_rms_norm_cpp(x, r, w, EPS, 1, store, passes, task_bytes)
        _check(res, x64 + r64)
        _check(out, _rms64(x64 + r64, w64))
    x_in, r_in = _inputs(shape, dtype, view=view)[:2]  # views of fresh copies, written in place
    add_rms.add_rms_norm_cpp_(x_in, r_in, w, EPS, 4, passes, task_bytes)
    _check(r_in, x64 + r64)
    _check(x_in, _rms64(x64 + r64, w64))


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    rms.load_extension()
    add_rms.load_extension()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("passes", "task_bytes"), PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_paths_match_float64(shape, dtype, passes, task_bytes):
    check_paths(shape, dtype, passes, task_bytes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("passes", cpu_store.PASSES_CHOICES)
def test_strided_rows_are_handled(dtype, passes):
    check_paths((16, 2 * 1031), dtype, passes, 1 << 16, view=lambda t: t[::2, :1031])
    check_paths((16, 2 * 1031), dtype, passes, 0, view=lambda t: t[:, ::2])  # copied first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting", ["none", "llama", "gemma"])
@pytest.mark.parametrize("width", [1, 7, 33, 4097])
def test_one_pass_is_two_pass_bit_for_bit(width, casting, dtype):
    # The one-pass rows sum the same squares in the same order: a module's numerics (ATen's
    # order, the rounded sum) stay exact in either path.
    x, r, w = _inputs((6, width), dtype, seed=width)
    two = rms.rms_norm_cpp_with(x, w, EPS, 1, casting, 0.5, "plain", "two")
    assert torch.equal(rms.rms_norm_cpp_with(x, w, EPS, 1, casting, 0.5, "plain", "one"), two)
    out2, res2 = add_rms.add_rms_norm_cpp_with(x, r, w, EPS, 1, casting, 0.5, "plain", "two")
    out1, res1 = add_rms.add_rms_norm_cpp_with(x, r, w, EPS, 1, casting, 0.5, "plain", "one")
    assert torch.equal(out1, out2) and torch.equal(res1, res2)
    x_in, r_in = x.clone(), r.clone()
    add_rms.add_rms_norm_cpp_with_(x_in, r_in, w, EPS, 1, casting, 0.5, "one", 1 << 16)
    assert torch.equal(x_in, out2) and torch.equal(r_in, res2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("task_bytes", [0, 1 << 16, 1 << 40])
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_grain_by_bytes_matches_float64(shape, task_bytes, dtype):
    layer.load_extension()
    x, _, w = _inputs(shape, dtype)
    b = torch.linspace(-1, 1, shape[-1]).to(dtype)
    expected = torch.nn.functional.layer_norm(x.double(), (shape[-1],), w.double(), b.double(),
                                              EPS)
    for row_group in cpu_store.ROW_GROUP_CHOICES:
        _check(layer.layer_norm_cpp(x, w, b, EPS, 1, "plain", "welford", row_group, task_bytes),
               expected)
    with pytest.raises(RuntimeError, match="task_bytes must be >= 0"):
        layer.layer_norm_cpp(x, w, b, EPS, 1, "plain", "welford", 1, -1)
    assert "task_bytes must be >= 0" in layer.param_error(shape, 1, "plain", "welford", 1, -1)


def test_one_pass_has_a_gradient():
    x, r, w = (t.requires_grad_() for t in _inputs((4, 33), torch.float32))
    grads = []
    for passes in cpu_store.PASSES_CHOICES:
        out, res = add_rms.add_rms_norm_cpp(x, r, w, EPS, 1, "plain", passes)
        y = rms.rms_norm_cpp(x, w, EPS, 1, "plain", passes)
        grads.append(torch.autograd.grad((out.sum() + res.square().sum() + y.sum()), (x, r, w)))
    for one, two in zip(*grads, strict=True):
        torch.testing.assert_close(one, two)


def test_bad_path_choices_are_refused():
    x, r, w = _inputs((2, 64), torch.float32)
    with pytest.raises(RuntimeError, match="passes must be two or one"):
        rms.rms_norm_cpp(x, w, EPS, 1, "plain", "three")
    with pytest.raises(RuntimeError, match="task_bytes must be >= 0"):
        add_rms.add_rms_norm_cpp(x, r, w, EPS, 1, "plain", "two", -1)
    with pytest.raises(RuntimeError, match="passes must be two or one"):
        add_rms.add_rms_norm_cpp_(x, r, w, EPS, 1, "both")
    for param_error in (rms.param_error, add_rms.param_error):
        assert "passes must be one of two, one" in param_error((2, 64), 1, "plain", "three")
        assert "task_bytes must be >= 0" in param_error((2, 64), 1, "plain", "two", -1)
        wide = (2, cpu_store.ONE_PASS_MAX_ELEMENTS + 1)
        assert "rows of up to" in param_error(wide, 1, "plain", "one")
        assert param_error(wide, 1, "plain", "two", 1 << 16) is None


def test_inplace_sweep_offers_the_paths():
    assert add_rms.INPLACE_TUNABLES["passes"] == cpu_store.PASSES_CHOICES
    assert add_rms.INPLACE_TUNABLES["task_bytes"] == cpu_store.TASK_BYTES_CHOICES


def test_scalar_build_paths_match_float64():
    """The same paths built with no vector flags (at::vec's portable loops, plain stores)."""
    code = (
        "import torch\n"
        "from fusionlab.kernels import cpp_build\n"
        "from tests import test_cpp_bf16_paths as t\n"
        "assert cpp_build.vector_isa() == 'DEFAULT'\n"
        "t.rms.load_extension(); t.add_rms.load_extension()\n"
        "for shape in t.SHAPES:\n"
        "    for dtype in t.DTYPES:\n"
        "        for passes, task_bytes in t.PATHS:\n"
        "            t.check_paths(shape, dtype, passes, task_bytes)\n"
        "for width in (1, 7, 33, 4097):\n"
        "    for casting in ('none', 'llama', 'gemma'):\n"
        "        t.test_one_pass_is_two_pass_bit_for_bit(width, casting, torch.bfloat16)\n"
        "print('ok')\n"
    )
    run_in_scalar_build(("rmsnorm", "add_rmsnorm"), code, timeout_s=600)


@pytest.mark.parametrize("passes", cpu_store.PASSES_CHOICES)
def test_paths_overloads_pass_opcheck(passes):
    # Schema, fake kernels, autograd registration and torch.compile tracing of the new overloads.
    layer.load_extension()
    x, r, w = (t.requires_grad_() for t in _inputs((4, 40), torch.float32))
    b = torch.zeros(40, requires_grad=True)
    ops = torch.ops.fusionlab
    torch.library.opcheck(ops.rms_norm_cpu.paths, (x, w, EPS, 1, "none", 0.0, "plain", passes,
                                                   1 << 16))
    torch.library.opcheck(ops.add_rms_norm_cpu.paths, (x, r, w, EPS, 1, "gemma", 1.0, "plain",
                                                       passes, 1 << 16))
    torch.library.opcheck(ops.layer_norm_cpu.paths, (x, w, b, EPS, 1, "plain", "welford", 1,
                                                     1 << 16))
    x_in, r_in = x.detach().clone(), r.detach().clone()
    torch.library.opcheck(ops.add_rms_norm_cpu_.default, (x_in, r_in, w.detach(), EPS, 1, "none",
                                                          0.0, passes, 1 << 16))

"""The C++ CPU kernels' code paths against float64: store kinds (plain, stream, auto), LayerNorm's
statistics (welford, shifted) and row groups at awkward shapes, and the same kernels built with no
vector ISA (FUSIONLAB_CPP_ISA=scalar)."""


import pytest
import torch
from helpers import run_in_scalar_build

from fusionlab.kernels import cpp_build, cpu_store
from fusionlab.kernels.add_layernorm import cpu_cpp as add_layer
from fusionlab.kernels.add_rmsnorm import cpu_cpp as add_rms
from fusionlab.kernels.layernorm import cpu_cpp as layer
from fusionlab.kernels.rmsnorm import cpu_cpp as rms

_UNAVAILABLE = cpp_build.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")

EPS = 1e-6
# One rounding of the fp32 result to the output dtype, plus fp32 accumulation error.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-8 + 1e-5, 1e-5)}
# 1 row; widths odd, below one vector, not a multiple of it; one streamable (64 x 4096).
SHAPES = ((1, 4096), (3, 33), (5, 1000), (2, 7), (64, 4096))


def _inputs(shape, dtype, seed=0, view=lambda t: t):
    """x and residual (seen through `view`), and weight and bias of the viewed width."""
    g = torch.Generator().manual_seed(seed)
    x, r = (view(torch.randn(shape, generator=g).mul_(3).add_(1).to(dtype)) for _ in range(2))
    w, b = (torch.randn(x.shape[-1], generator=g).to(dtype) for _ in range(2))
    return x, r, w, b


def _rms64(s, w):
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w


def _check(out, expected):
    rtol, atol = TOL[out.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


def run_all(shape, dtype, store, view=lambda t: t):
    """Every op at this shape and store kind against float64 (x given through `view`)."""
    xv, rv, w, b = _inputs(shape, dtype, view=view)
    x64, r64, w64, b64 = (t.double() for t in (xv, rv, w, b))
    _check(rms.rms_norm_cpp(xv, w, EPS, 1, store=store), _rms64(x64, w64))
    expected_ln = torch.nn.functional.layer_norm(x64, (x64.shape[-1],), w64, b64, EPS)
    for stats in cpu_store.STATS_CHOICES:
        for row_group in cpu_store.ROW_GROUP_CHOICES:  # 4 with fewer rows: the leftover path
            _check(layer.layer_norm_cpp(xv, w, b, EPS, 1, store, stats, row_group), expected_ln)
    out, res = add_rms.add_rms_norm_cpp(xv, rv, w, EPS, 1, store=store)
    s64 = x64 + r64
    _check(res, s64)
    _check(out, _rms64(s64, w64))


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    for module in (rms, layer, add_rms):
        module.load_extension()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store", ["auto", "plain", "stream"])
@pytest.mark.parametrize("shape", SHAPES)
def test_store_kinds_match_float64(shape, dtype, store):
    run_all(shape, dtype, store)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store", ["auto", "plain", "stream"])
@pytest.mark.parametrize("shape", SHAPES)
def test_add_layernorm_store_kinds_match_float64(shape, dtype, store):
    add_layer.load_extension()
    xv, rv, w, b = _inputs(shape, dtype)
    s64 = xv.double() + rv.double()
    expected = torch.nn.functional.layer_norm(s64, (s64.shape[-1],), w.double(), b.double(), EPS)
    for stats in cpu_store.STATS_CHOICES:
        for row_group in cpu_store.ROW_GROUP_CHOICES:
            out, res = add_layer.add_layer_norm_cpp(xv, rv, w, b, EPS, 1, store, stats, row_group)
            _check(res, s64)
            _check(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_columns_are_handled(dtype):
    run_all((64, 8192), dtype, "stream", view=lambda t: t[::2, :4096])  # uniform row stride
    run_all((64, 8192), dtype, "stream", view=lambda t: t[:, ::2])  # copied first


def test_stream_output_is_published_before_return():
    # Non-temporal stores must be fenced: a second op reading the output sees every value.
    x, _, w, _ = _inputs((256, 4096), torch.float32)
    y = rms.rms_norm_cpp(x, w, EPS, 1, store="stream")
    assert torch.equal(y, rms.rms_norm_cpp(x, w, EPS, 1, store="plain"))


@pytest.mark.parametrize("stats", cpu_store.STATS_CHOICES)
def test_layernorm_stats_survive_a_large_mean(stats):
    # mean/std = 1000: plain E[x^2] - E[x]^2 in fp32 would be off by tens of percent here; the
    # shifted sums subtract the first block's mean first, so both stay at fp32 roundoff.
    g = torch.Generator().manual_seed(3)
    x = 1000 + torch.randn(9, 4096, generator=g)
    w, b = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    expected = torch.nn.functional.layer_norm(x.double(), (4096,), w.double(), b.double(), EPS)
    out = layer.layer_norm_cpp(x, w, b, EPS, 1, "plain", stats, 4)
    torch.testing.assert_close(out.double(), expected, rtol=0.0, atol=3e-4)


def test_layernorm_layout_choices_are_checked():
    x, _, w, b = _inputs((8, 64), torch.float32)
    with pytest.raises(RuntimeError, match="stats must be welford or shifted"):
        layer.layer_norm_cpp(x, w, b, EPS, 1, "plain", "exact", 1)
    with pytest.raises(RuntimeError, match="row_group must be 1 or 4"):
        layer.layer_norm_cpp(x, w, b, EPS, 1, "plain", "welford", 3)
    assert "needs at least 4 rows" in layer.param_error((3, 64), 1, "plain", "welford", 4)
    assert layer.param_error((4, 64), 1, "plain", "shifted", 4) is None


def test_unknown_store_is_refused():
    x, r, w, _ = _inputs((2, 64), torch.float32)
    with pytest.raises(RuntimeError, match="store must be auto, plain or stream"):
        rms.rms_norm_cpp(x, w, EPS, 1, store="fast")
    with pytest.raises(RuntimeError, match="store must be auto, plain or stream"):
        add_rms.add_rms_norm_cpp(x, r, w, EPS, 1, store="nt")
    assert "store must be one of" in rms.param_error((2, 64), 1, store="fast")


def test_isa_choice_is_checked(monkeypatch):
    monkeypatch.setenv(cpp_build.ISA_ENV, "sse9")
    assert "use one of auto, avx512, avx2, scalar" in cpp_build.unavailable_reason()
    monkeypatch.setenv(cpp_build.ISA_ENV, "scalar")
    assert cpp_build.vector_isa() == "DEFAULT"
    assert "-mavx2" not in cpp_build.build_flags()[0]
    assert "scalar" in rms.param_error((2048, 4096), 1, store="stream")


def test_scalar_build_matches_float64():
    """The kernels built with no vector flags (at::vec's portable loops, no streaming) give the
    same results; each op's extension is built in a process of its own, all at once."""
    code = (
        "import torch\n"
        "from fusionlab.kernels import cpp_build\n"
        "from tests import test_cpu_kernel_paths as t\n"
        "assert cpp_build.vector_isa() == 'DEFAULT'\n"
        "for m in (t.rms, t.layer, t.add_rms, t.add_layer):\n"
        "    m.load_extension()\n"
        "for shape in t.SHAPES:\n"
        "    for dtype in (torch.float32, torch.bfloat16):\n"
        "        t.run_all(shape, dtype, 'auto')\n"
        "        t.test_add_layernorm_store_kinds_match_float64(shape, dtype, 'auto')\n"
        "print('ok')\n"
    )
    run_in_scalar_build(("rmsnorm", "layernorm", "add_rmsnorm", "add_layernorm"), code,
                        timeout_s=300)

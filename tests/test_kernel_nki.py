"""NKI kernels without Trainium: plans and tiling, LNC degree, availability, argument checks.

The kernels' bodies run in tests/test_nki_replay.py (a NumPy model of NKI, not the hardware).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import itertools
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

from fusionlab.kernels import nki_common
from fusionlab.kernels.add_layernorm import nki_kernel as add_layer
from fusionlab.kernels.add_rmsnorm import nki_kernel as add_rms
from fusionlab.kernels.layernorm import nki_kernel as layer
from fusionlab.kernels.layernorm import nki_tiling as layer_tiling
from fusionlab.kernels.nki_common import (
    LNC_SPLITS,
    MIN_SBUF_PARTITION_BYTES,
    PMAX,
    lnc_degree,
    program_rows,
    span,
    tile_partitions,
)
from fusionlab.kernels.rmsnorm import nki_kernel as rms
from fusionlab.kernels.rmsnorm import nki_tiling as rms_tiling

MODULES = (rms, layer, add_rms)
ROWS = (1, 2, 127, 128, 129, 300)


@pytest.mark.parametrize("lnc_split", LNC_SPLITS)
@pytest.mark.parametrize("programs", [1, 2])
@pytest.mark.parametrize("rows", ROWS)
def test_program_rows_cover_every_row_once(rows, programs, lnc_split):
    covered = np.zeros(rows, dtype=int)
    for p in range(programs):
        start, stop = program_rows(rows, lnc_split, p, programs)
        assert 0 <= start <= stop <= rows
        covered[start:stop] += 1
    assert (covered == 1).all()
    parts = tile_partitions(rows, lnc_split, programs)
    assert 1 <= parts <= PMAX
    if rows >= PMAX * programs:
        assert parts == PMAX  # no idle partitions once there are enough rows


def test_lnc2_row_split_is_even_and_none_keeps_one_core():
    assert [program_rows(300, "rows", p, 2) for p in range(2)] == [(0, 150), (150, 300)]
    assert [program_rows(1, "rows", p, 2) for p in range(2)] == [(0, 0), (0, 1)]
    assert [program_rows(300, "none", p, 2) for p in range(2)] == [(0, 300), (0, 0)]
    assert tile_partitions(129, "rows", 2) == 65 and tile_partitions(129, "none", 2) == 128


@pytest.mark.parametrize(("hidden", "chunk"), [(1, 512), (1000, 512), (5000, 2048), (8192, 8192)])
def test_chunks_cover_hidden_once(hidden, chunk):
    width = min(chunk, hidden)
    spans = [span(c, width, hidden) for c in range(nki_common.ceil_div(hidden, width))]
    assert spans[0][0] == 0 and spans[-1][1] == hidden
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(0 < stop - start <= width for start, stop in spans)


def test_lnc_degree_reads_the_documented_variable_then_the_compiler_default():
    assert lnc_degree({"NEURON_LOGICAL_NC_CONFIG": "1"})[0] == 1
    assert lnc_degree({"NEURON_LOGICAL_NC_CONFIG": "2"})[0] == 2
    assert lnc_degree({})[0] == 2  # neuronx-cc's default on Trn2 and later (NCC_EVRF066)
    assert lnc_degree({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"})[0] == 1
    assert "unset" in lnc_degree({})[1]
    with pytest.raises(ValueError, match="1 or 2"):
        lnc_degree({"NEURON_LOGICAL_NC_CONFIG": "4"})


def test_generation_and_sbuf_budget():
    assert nki_common.generation({}) == "trn2"
    assert nki_common.generation({"NEURON_PLATFORM_TARGET_OVERRIDE": "gen2"}) == "trn1"
    assert nki_common.sbuf_partition_bytes("trn1") == 192 * 1024
    assert nki_common.sbuf_partition_bytes("trn2") == 224 * 1024
    with pytest.raises(ValueError, match="NEURON_PLATFORM_TARGET_OVERRIDE"):
        nki_common.generation({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn9"})


@pytest.mark.parametrize("tiling", [rms_tiling, layer_tiling], ids=["rmsnorm", "layernorm"])
def test_plan_keeps_x_resident_whenever_it_fits(tiling):
    for hidden, x_bytes in itertools.product((1, 1000, 4096, 8192), (2, 4)):
        plan = tiling.make_plan(2048, hidden, 2048, "rows", lnc=2, budget=192 * 1024,
                                x_bytes=x_bytes, w_bytes=4)
        assert plan.resident and plan.x_reads == 1 and plan.sbuf_bytes <= plan.budget
        assert plan.sbuf_bytes == tiling.sbuf_bytes(hidden, plan.chunk, x_bytes, 4, True)
    streamed = tiling.make_plan(4, 30_000 if tiling is rms_tiling else 16_500, 512, "rows",
                                lnc=1, budget=192 * 1024, x_bytes=4, w_bytes=4)
    assert not streamed.resident and streamed.x_reads > 1


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.split(".")[-2])
def test_every_tunable_point_is_accepted_at_the_default_shapes(module):
    shapes = [(1, 4096), (32, 4096), (128, 4096), (512, 4096), (2048, 4096), (2048, 8192),
              (4, 2048, 4096), (1, 1), (7, 5000)]
    for shape, values in itertools.product(shapes, itertools.product(*module.TUNABLES.values())):
        params = dict(zip(module.TUNABLES, values, strict=True))
        assert module.param_error(shape, **params) is None, (shape, params)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.split(".")[-2])
@pytest.mark.parametrize(
    ("shape", "params", "fragment"),
    [
        ((0, 64), dict(free_chunk=512, lnc_split="rows"), ">= 1"),
        ((), dict(free_chunk=512, lnc_split="rows"), "at least one dimension"),
        ((4, 64), dict(free_chunk=1000, lnc_split="rows"), "free_chunk"),
        ((4, 64), dict(free_chunk=512.0, lnc_split="rows"), "int"),
        ((4, 64), dict(free_chunk=512, lnc_split="cols"), "lnc_split"),
        ((4, 64), dict(free_chunk=512), "tunables must be exactly"),
        ((4, 100_000), dict(free_chunk=512, lnc_split="rows"), "SBUF"),
    ],
    ids=["zero-dim", "scalar", "chunk-value", "chunk-type", "split", "missing", "too-wide"],
)
def test_param_error_rejects(module, shape, params, fragment):
    error = module.param_error(shape, **params)
    assert error is not None and fragment in error


def test_add_rmsnorm_rejects_a_hidden_whose_fp32_sum_cannot_stay():
    error = add_rms.param_error((4, 40_000), free_chunk=512, lnc_split="rows")
    assert error is not None and str(MIN_SBUF_PARTITION_BYTES) in error
    assert rms.param_error((4, 40_000), free_chunk=512, lnc_split="rows") is None  # streams


def test_tunables_match_the_kernel_keywords():
    import inspect

    for module, fn in ((rms, rms.rms_norm_nki), (layer, layer.layer_norm_nki),
                       (add_rms, add_rms.add_rms_norm_nki)):
        keywords = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert keywords == list(module.TUNABLES)


def _attributes_used(code, name: str) -> set[str]:
    """Every `name.attr` in the code of a module or function (docstrings and comments aside),
    and in the shared helpers it hands `name` to: a call `helper(..., name, ...)`, or
    `functools.partial(helper, ..., name, ...)`, counts the attributes `helper` takes of its own
    parameter at that position, helpers of helpers too."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    used = {
        node.attr for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id == name
    }
    scope = vars(inspect.getmodule(code))
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        helper, args = _called(scope, call.func), call.args
        if helper is functools.partial and args:
            helper, args = _called(scope, args[0]), args[1:]
        if not inspect.isfunction(helper) or helper is code:
            continue
        params = list(inspect.signature(helper).parameters)
        for position, arg in enumerate(args):
            if isinstance(arg, ast.Name) and arg.id == name:
                used |= _attributes_used(helper, params[position])
    return used


def _called(scope: dict, func: ast.expr) -> object:
    """What a call's `func`, a bare name or `module.name` of an imported module, is bound to in
    `scope` (None for any other expression)."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = scope.get(func.value.id)
        return getattr(owner, func.attr, None) if inspect.ismodule(owner) else None
    return scope.get(func.id) if isinstance(func, ast.Name) else None


def _fake_neuron_sdk(monkeypatch, nl_names=(), nisa_names=(), nki_attrs=("jit", "simulate"),
                     torch_neuronx_attrs=("nki_op",), device: bool | None = None) -> None:
    """Stand-ins for the Neuron SDK's packages (not installable here, and no Trainium exists
    here), holding exactly the given names; `device` None leaves torch.neuron unregistered."""
    packages = {name: types.ModuleType(name)
                for name in ("nki", "nki.language", "nki.isa", "torch_neuronx")}
    for module, names in ((packages["nki"], nki_attrs), (packages["nki.language"], nl_names),
                          (packages["nki.isa"], nisa_names),
                          (packages["torch_neuronx"], torch_neuronx_attrs)):
        for name in names:
            setattr(module, name, object())
    packages["nki"].language, packages["nki"].isa = packages["nki.language"], packages["nki.isa"]
    for name, module in packages.items():
        monkeypatch.setitem(sys.modules, name, module)
    if device is not None:
        monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(is_available=lambda: device),
                            raising=False)
    else:
        monkeypatch.delattr(torch, "neuron", raising=False)


NEURON_SDK_HERE = any(importlib.util.find_spec(n) for n in ("nki", "torch_neuronx"))


@pytest.mark.skipif(NEURON_SDK_HERE, reason="the Neuron SDK is installed here")
@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.split(".")[-2])
def test_unavailable_reasons_explain_themselves_here(module):
    assert module.unavailable_reason().startswith("torch-neuronx is not installed (")
    assert module.simulator_unavailable_reason().startswith("nki is not installed (")


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.split(".")[-2])
def test_each_missing_piece_of_the_neuron_sdk_gives_its_own_reason(module, monkeypatch):
    complete = {"nl_names": module.NL_NAMES, "nisa_names": module.NISA_NAMES}
    _fake_neuron_sdk(monkeypatch, torch_neuronx_attrs=(), **complete)
    assert "torch-neuronx has no nki_op" in module.unavailable_reason()
    _fake_neuron_sdk(monkeypatch, **complete)
    assert module.unavailable_reason().startswith("torch.neuron is missing")
    assert module.simulator_unavailable_reason() is None
    _fake_neuron_sdk(monkeypatch, device=False, **complete)
    assert module.unavailable_reason().startswith("no Neuron device")
    _fake_neuron_sdk(monkeypatch, device=True, **complete)
    assert module.unavailable_reason() is None
    _fake_neuron_sdk(monkeypatch, device=True, nki_attrs=("jit",), **complete)
    assert module.unavailable_reason() is None  # running needs no simulator
    assert "nki lacks nki.simulate:" in module.simulator_unavailable_reason()


@pytest.mark.parametrize("module", (*MODULES, add_layer), ids=lambda m: m.__name__.split(".")[-2])
def test_availability_check_asks_for_exactly_the_names_used(module, monkeypatch):
    assert len(set(module.NL_NAMES)) == len(module.NL_NAMES)
    assert set(module.NL_NAMES) == _attributes_used(module, "nl")
    assert set(module.NISA_NAMES) == _attributes_used(module, "nisa")
    # Each name is asked for: an nki without it is refused, naming exactly that one.
    for dropped in (module.NL_NAMES[-1], module.NISA_NAMES[-1]):
        nl_names = [n for n in module.NL_NAMES if n != dropped]
        nisa_names = [n for n in module.NISA_NAMES if n != dropped]
        _fake_neuron_sdk(monkeypatch, nl_names=nl_names, nisa_names=nisa_names, device=True)
        reason = module.unavailable_reason()
        where = "language" if dropped in module.NL_NAMES else "isa"
        assert reason.startswith(f"nki lacks nki.{where}.{dropped}:"), reason


def test_bad_parameters_raise_before_touching_neuron():
    x, w, b = torch.randn(4, 64), torch.randn(64), torch.randn(64)
    with pytest.raises(ValueError, match="free_chunk"):
        rms.rms_norm_nki(x, w, 1e-6, free_chunk=3, lnc_split="rows")
    with pytest.raises(ValueError, match="weight shape"):
        rms.rms_norm_nki(x, torch.randn(63), 1e-6, free_chunk=512, lnc_split="rows")
    with pytest.raises(ValueError, match="bias shape"):
        layer.layer_norm_nki(x, w, torch.randn(3), 1e-5, free_chunk=512, lnc_split="rows")
    with pytest.raises(ValueError, match="residual"):
        add_rms.add_rms_norm_nki(x, x[:2], w, 1e-6, free_chunk=512, lnc_split="rows")
    with pytest.raises(ValueError, match="dtype"):
        layer.layer_norm_nki(x.double(), w, b, 1e-5, free_chunk=512, lnc_split="rows")


@pytest.mark.skipif(rms.unavailable_reason() is None, reason="a Neuron device is present")
def test_kernels_raise_the_reason_without_neuron():
    x, w = torch.randn(2, 3, 64)[:, :, :64], torch.randn(64)
    for call, module in (
        (lambda: rms.rms_norm_nki(x, w, 1e-6, free_chunk=512, lnc_split="rows"), rms),
        (lambda: layer.layer_norm_nki(x, w, w, 1e-5, free_chunk=512, lnc_split="rows"), layer),
        (lambda: add_rms.add_rms_norm_nki(x, x, w, 1e-6, free_chunk=512, lnc_split="rows"),
         add_rms),
    ):
        with pytest.raises(RuntimeError) as info:
            call()
        assert str(info.value) == module.unavailable_reason()

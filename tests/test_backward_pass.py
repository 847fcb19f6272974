"""The pass as a sweep dimension: backward and forward+backward trials gate every gradient
against float64 autograd, catch backwards that do less work, and run as real sweeps."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from conftest import PLUGINS, cpu_cell, run_cli
from helpers import GATE_TIMING as FAST
from helpers import sqlite_url

from fusionlab.measure.passes import (
    BACKWARD,
    FORWARD_BACKWARD,
    ROUNDED_SUM_SPREAD,
    gradient_tolerance,
    pass_spec,
)
from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.records import Status
from fusionlab.registry import get_op, load_plugin
from fusionlab.report.tables import best_rows
from fusionlab.results import Decision
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage
from fusionlab.winners import footprint_mb

load_plugin(str(PLUGINS / "grad_cheats.py"))
CHEATS = next(
    module.EXPECTED for name, module in sys.modules.items()
    if name.startswith("fusionlab_plugin_grad_cheats_")
)


def _trial(op: str, shape: tuple[int, ...], dtype: str, pass_name: str, variant: str,
           params: dict | None = None):
    cell = dataclasses.replace(cpu_cell(op, shape, dtype), pass_name=pass_name)
    return run_trial(TrialTask(cell, variant, params or {}, seed=3, timing=FAST))


@pytest.mark.parametrize("pass_name", [BACKWARD, FORWARD_BACKWARD])
@pytest.mark.parametrize("variant", CHEATS)
def test_gradient_gate_rejects_backwards_that_do_less_work(variant: str, pass_name: str) -> None:
    record = _trial("rmsnorm", (16, 256), "float32", pass_name, variant)
    assert record.status in (Status.INCORRECT, Status.STALE_RESULT), record.message
    assert "dx" in record.message or "dweight" in record.message, record.message
    assert "\n" not in record.message


def test_cheats_have_honest_forwards() -> None:
    """What the gradient gate catches, the forward's gate cannot: their forward is right."""
    for variant in CHEATS:
        record = _trial("rmsnorm", (16, 256), "float32", "forward", variant)
        assert record.status is Status.PASSED, record.message


HONEST = [("rmsnorm", "naive", {}), ("rmsnorm", "builtin", {}),
          ("rmsnorm", "cpp", {"rows_per_task": 4}), ("layernorm", "builtin", {}),
          ("layernorm", "cpp", {"rows_per_task": 4}), ("add_rmsnorm", "naive", {}),
          ("rmsnorm", "cpp", {"rows_per_task": 4, "backward": "fused"}),
          ("layernorm", "cpp", {"rows_per_task": 4, "backward": "fused"}),
          ("rmsnorm", "cpp", {"rows_per_task": 4, "backward": "fused-saved"}),
          ("layernorm", "cpp", {"rows_per_task": 4, "backward": "fused-saved"}),
          ("add_rmsnorm", "cpp", {"rows_per_task": 4}),
          ("add_rmsnorm", "cpp", {"rows_per_task": 4, "backward": "fused"}),
          ("add_layernorm", "cpp", {"rows_per_task": 4, "backward": "fused"})]


@pytest.mark.parametrize(("op", "variant", "params"), HONEST)
def test_honest_backwards_pass_the_gradient_gate(op: str, variant: str, params: dict) -> None:
    """No false positives: backward in bfloat16 at many rows (the weight gradient's sum grows
    with them), forward+backward in float32 at few."""
    for shape, dtype, pass_name in [((1024, 64), "bfloat16", BACKWARD),
                                    ((3, 5, 96), "float32", FORWARD_BACKWARD)]:
        record = _trial(op, shape, dtype, pass_name, variant, params)
        where = f"{op} {shape} {dtype} {pass_name} {variant}"
        assert record.status is Status.PASSED, f"{where}: {record.message}"
        assert record.accuracy is not None and record.accuracy.max_abs_err > 0.0
        # Plausible memory: the backward keeps at least x's rows (or the sum's) and writes dx.
        x_bytes = torch.finfo(getattr(torch, dtype)).bits // 8 * shape[0] * shape[-1] * (
            shape[1] if len(shape) == 3 else 1)
        assert record.memory is not None, where
        assert record.memory.saved_bytes >= x_bytes, (where, record.memory)
        assert record.memory.backward_peak_bytes >= x_bytes, (where, record.memory)


def test_a_variant_without_backward_is_unsupported() -> None:
    record = _trial("add_rmsnorm", (4, 64), "float32", BACKWARD, "builtin-inplace")
    assert record.status is Status.UNSUPPORTED
    assert "no backward" in record.message


def test_gradient_references_are_float64_autograd() -> None:
    """The pass's references are the float64 reference's autograd gradients; the weight's
    tolerance grows with the square root of the rows it sums over."""
    spec = pass_spec(get_op("rmsnorm"), BACKWARD, (64, 32), torch.float32)
    assert spec.outputs == ("dx", "dweight")
    x, weight, eps, grad = spec.make_inputs((64, 32), torch.float32, torch.device("cpu"), 1)
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w64
    y.backward(grad.double())
    dx, dweight = spec.reference((x, weight, eps, grad))
    assert torch.allclose(dx, x64.grad) and torch.allclose(dweight, w64.grad)
    dx_tol, dweight_tol = spec.tolerance(torch.float32)
    linear = ROUNDED_SUM_SPREAD * 64 * torch.finfo(torch.float32).eps / 2
    assert dweight_tol.atol == pytest.approx(dx_tol.atol * 8 + linear)  # sqrt(64 rows)


def test_backward_and_forward_backward_sweeps_decide_cells(tmp_path) -> None:
    storage = sqlite_url(tmp_path / "passes.db")
    for pass_name in (BACKWARD, FORWARD_BACKWARD):
        done = run_cli("sweep", "rmsnorm", "--quick", "--shapes", "64x512", "--variants",
                       "naive,cpp", "--pass", pass_name, "--storage", storage, "--no-screen",
                       cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert pass_name in done.stdout
    cells = load_cells(open_storage(storage, must_exist=True, read_only=True), "rmsnorm")
    assert sorted(cell.cell.pass_name for cell in cells) == [BACKWARD, FORWARD_BACKWARD]
    for cell in cells:
        assert cell.verdicts, f"{cell.cell.label}: not decided"
        assert all(record.passed for record in cell.records), [
            (r.variant, r.message) for r in cell.records if not r.passed]
        # The cpp variant's backward tunable is swept: both backwards measured, and gated.
        backwards = {r.params.get("backward") for r in cell.records if r.variant == "cpp"}
        assert backwards == {"torch-ops", "fused", "fused-saved"}, (cell.cell.label, backwards)
        _check_memory_budget(cell)
    refused = run_cli("export", "rmsnorm", "--storage", storage, "--memory-budget", "0",
                      cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr


def _check_memory_budget(cell) -> None:
    """--memory-budget: the winner is the fastest configuration whose footprint fits; a budget
    below every footprint leaves the cell without one."""
    footprints = sorted(f for r in cell.records if (f := footprint_mb(r)) is not None)
    fastest = cell.ranked("cold")[0]
    budget = footprints[0]  # only the smallest footprint(s) fit
    (row,) = best_rows([cell], "cold", memory_budget_mb=budget)
    fitting = [r for r in cell.ranked("cold") if (footprint_mb(r) or budget + 1) <= budget]
    assert (row.variant, row.params) == (fitting[0].variant, fitting[0].params)
    assert "saved + peak <= " in row.ranked_by
    if footprint_mb(fastest) > budget:
        assert row.decision is Decision.WITHIN_BUDGET
    (none,) = best_rows([cell], "cold", memory_budget_mb=budget * 0.99)
    assert none.variant is None and none.label.startswith("none within")


def test_a_compiled_backward_runs_from_a_retained_graph() -> None:
    """torch.compile with dynamic shapes builds a backward that donates its saved tensors'
    memory, which refuses retain_graph: the backward pass turns donation off."""
    record = _trial("rmsnorm", (64, 128), "float32", BACKWARD, "compiled",
                    {"mode": "default", "dynamic": True})
    assert record.status is Status.PASSED, record.message


def test_torchs_own_bf16_layernorm_weight_gradients_are_within_tolerance() -> None:
    """torch's bfloat16 layer_norm backward rounds its partial sums: at 4096 rows its dbias
    strays past a tolerance of n * u for one of these seeds; the gate must not refuse it."""
    spec = get_op("layernorm")
    shape = (4096, 256)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        x, weight, bias, grad = (
            torch.randn(size, generator=generator).bfloat16()
            for size in (shape, shape[-1:], shape[-1:], shape)
        )
        leaves = [t.requires_grad_() for t in (x, weight, bias)]
        y = torch.nn.functional.layer_norm(x, shape[-1:], weight, bias, 1e-5)
        ours = torch.autograd.grad(y, leaves, grad)
        exact = [t.detach().double().requires_grad_() for t in leaves]
        y64 = torch.nn.functional.layer_norm(exact[0], shape[-1:], exact[1], exact[2], 1e-5)
        reference = torch.autograd.grad(y64, exact, grad.double())
        for name, got, want in zip(("weight", "bias"), ours[1:], reference[1:], strict=True):
            tolerance = gradient_tolerance(spec, shape, torch.bfloat16, name)
            excess = (got.double() - want).abs() - tolerance.atol - tolerance.rtol * want.abs()
            assert excess.max().item() <= 0, (seed, name, excess.max().item())

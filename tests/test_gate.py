"""The gate cannot be gamed: adversarial variants, several per principle, each earn the status
of the rule they break; honest variants of every kind pass at every default shape."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import PLUGINS, cpu_cell
from helpers import GATE_TIMING as FAST

from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.records import Status
from fusionlab.registry import get_op, load_plugin, register_variant

load_plugin(str(PLUGINS / "gaming.py"))
EXPECTED = next(  # gaming.py's own module, not another gaming_*.py plugin loaded before it
    module.EXPECTED for name, module in list(sys.modules.items())
    if name.startswith("fusionlab_plugin_gaming_")
    and getattr(module, "__file__", None) == str(PLUGINS / "gaming.py")
)

CASES = [(principle, *case) for principle, cases in EXPECTED.items() for case in cases]


@pytest.mark.parametrize(("principle", "variant", "status"), CASES)
@pytest.mark.parametrize("shape", [(8, 256), (3, 5, 96)])
def test_adversarial_variant_is_caught(
    principle: str, variant: str, status: str | tuple[str, ...], shape
) -> None:
    record = run_trial(TrialTask(cpu_cell("rmsnorm", shape), variant, {}, seed=2, timing=FAST))
    statuses = (status,) if isinstance(status, str) else status
    assert record.status.value in statuses, f"{principle}: {record.message}"
    assert record.message and "\n" not in record.message
    assert not record.passed


@register_variant("add_rmsnorm", "game-undeclared-inplace", devices=("cpu",))
def undeclared_inplace(device_type: str):
    """Updates the residual in place without declaring it."""

    def kernel(x, residual, weight, eps):
        residual.add_(x)
        return torch.rms_norm(residual, (x.shape[-1],), weight, eps), residual.clone()

    return kernel


@register_variant("add_rmsnorm", "game-declared-but-fresh", devices=("cpu",),
                  inplace={"residual_out": "residual"})
def declared_but_fresh(device_type: str):
    """Declares an in-place residual but returns fresh memory."""

    def kernel(x, residual, weight, eps):
        total = x + residual
        return torch.rms_norm(total, (x.shape[-1],), weight, eps), total

    return kernel


@pytest.mark.parametrize(("variant", "message"), [
    ("game-undeclared-inplace", "modified input 'residual'"),
    ("game-declared-but-fresh", "declared in place"),
])
def test_a_variant_mutates_exactly_what_it_declares(variant: str, message: str) -> None:
    record = run_trial(TrialTask(cpu_cell("add_rmsnorm", (4, 64)), variant, {}, timing=FAST))
    assert record.status is Status.INCORRECT and message in record.message


def test_declared_inplace_variant_passes() -> None:
    record = run_trial(TrialTask(cpu_cell("add_rmsnorm", (4, 64), "bfloat16"), "builtin-inplace",
                                 {}, timing=FAST))
    assert record.status is Status.PASSED, record.message


HONEST = {
    "rmsnorm": [("naive", {}), ("builtin", {}), ("compiled", {"mode": "default", "dynamic": False}),
                ("cpp", {"rows_per_task": 4})],
    "layernorm": [("naive", {}), ("builtin", {}),
                  ("compiled", {"mode": "default", "dynamic": False}),
                  ("cpp", {"rows_per_task": 4})],
    "add_rmsnorm": [("naive", {}), ("builtin", {}), ("builtin-inplace", {}),
                    ("compiled", {"mode": "default", "dynamic": False}),
                    ("cpp", {"rows_per_task": 4}), ("cpp-inplace", {"rows_per_task": 4})],
}


@pytest.mark.parametrize("op", sorted(HONEST))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_variants_pass_at_every_default_shape(op: str, dtype: str) -> None:
    """No false positives: every honest lowering passes the whole gate where the sweep runs it."""
    spec = get_op(op)
    for text in spec.default_shapes.split(","):
        shape = tuple(int(d) for d in text.split("x"))
        for variant, params in HONEST[op]:
            task = TrialTask(cpu_cell(op, shape, dtype), variant, params, timing=FAST)
            record = run_trial(task)
            assert record.status is Status.PASSED, f"{op} {text} {variant}: {record.message}"

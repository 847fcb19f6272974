"""The gate, round five: an adversary's round. The cheats of tests/plugins/gaming_round5.py that
the gate catches are run through the real worker (search trial, then re-measurement rounds and
audit) and must earn their status with the rule named; the honest control must pass. What got
through is described in docs/gate.md ("Red team, round five"), not tested here."""

from __future__ import annotations

import sys

import pytest
from conftest import PLUGINS, cpu_cell

from fusionlab.measure.rounds import RoundsTask, StopRule
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import Status
from fusionlab.registry import load_plugin

ROUND5 = str(PLUGINS / "gaming_round5.py")
load_plugin(ROUND5)
PLUGIN = next(module for name, module in sys.modules.items()
              if name.startswith("fusionlab_plugin_gaming_round5_"))
FAST = TimingSettings(warmup_s=0.005, budget_s=0.03, min_samples=8, max_samples=30)


@pytest.fixture(scope="module")
def worker():
    with TrialWorker(plugins=[ROUND5]) as trial_worker:
        yield trial_worker


def _search_then_decision(worker: TrialWorker, variant: str, shape: tuple[int, ...]) -> dict:
    """The search trial; if it passes, the cell's rounds and audit beside the built-in."""
    cell = cpu_cell("rmsnorm", shape)
    record = worker.run(TrialTask(cell, variant, {}, seed=2, timing=FAST), 300)
    if record["status"] != Status.PASSED.value:
        return record
    task = RoundsTask(cell, [("candidate", variant, {}), ("builtin", "builtin", {})], "warm",
                      StopRule(min_rounds=2, max_rounds=2), timing=FAST,
                      decided_ms={"candidate": record["timing"]["median_ms"]})
    return worker.run(task, 600)["contenders"]["candidate"]


@pytest.mark.parametrize(("variant", "expected"), sorted(PLUGIN.CAUGHT.items()))
def test_round_five_cheat_is_caught_with_the_rule_named(worker, variant, expected) -> None:
    statuses, word = expected
    outcome = _search_then_decision(worker, variant, (8, 256))
    assert outcome["status"] in statuses, f"{variant}: {outcome['message']}"
    assert word in outcome["message"] and "\n" not in outcome["message"], outcome["message"]


def test_the_cheat_that_swaps_a_pair_in_the_shared_sets_is_caught() -> None:
    """In a process of its own: it leaves the cell's shared input sets swapped behind it."""
    variant, statuses, word = PLUGIN.SABOTEUR
    with TrialWorker(plugins=[ROUND5]) as own:
        outcome = _search_then_decision(own, variant, (8, 256))
    assert outcome["status"] in statuses, f"{variant}: {outcome['message']}"
    assert word in outcome["message"] and "\n" not in outcome["message"], outcome["message"]


def test_the_honest_control_passes_the_search_the_rounds_and_the_audit(worker) -> None:
    outcome = _search_then_decision(worker, PLUGIN.HONEST, (32, 4096))
    assert outcome["status"] == Status.PASSED.value, outcome["message"]

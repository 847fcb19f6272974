"""The gate, round five: an adversary's round, and its fixes. The cheats of
tests/plugins/gaming_round5.py are run through the real worker (search trial, then
re-measurement rounds and audit) and must earn their status with the rule named: the sealed
dispatcher tables, the position-keyed input checksum, the refill probe inside the timing loop
(docs/gate.md, "Round five's fixes"); the honest control must pass, and an honest contender
audited on a busy machine is `unjudged`, never accused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import PLUGINS, cpu_cell, search_then_decision
from helpers import GATE_TIMING as FAST

from fusionlab.measure import integrity
from fusionlab.measure.correctness import check_values
from fusionlab.measure.inputs import tensors_in
from fusionlab.measure.rounds import RoundsTask, StopRule
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import Status
from fusionlab.registry import get_op, get_variant, load_plugin

ROUND5 = str(PLUGINS / "gaming_round5.py")
load_plugin(ROUND5)
PLUGIN = next(module for name, module in sys.modules.items()
              if name.startswith("fusionlab_plugin_gaming_round5_"))


@pytest.fixture(scope="module")
def worker():
    with TrialWorker(plugins=[ROUND5]) as trial_worker:
        yield trial_worker


@pytest.mark.parametrize(("variant", "expected"), sorted(PLUGIN.CAUGHT.items()))
def test_round_five_cheat_is_caught_with_the_rule_named(worker, variant, expected) -> None:
    statuses, word = expected
    outcome = search_then_decision(worker, variant, (8, 256))
    assert outcome["status"] in statuses, f"{variant}: {outcome['message']}"
    assert word in outcome["message"] and "\n" not in outcome["message"], outcome["message"]


def test_the_cheat_that_swaps_a_pair_in_the_shared_sets_is_caught() -> None:
    """In a process of its own: it leaves the cell's shared input sets swapped behind it."""
    variant, statuses, word = PLUGIN.SABOTEUR
    with TrialWorker(plugins=[ROUND5]) as own:
        outcome = search_then_decision(own, variant, (8, 256))
    assert outcome["status"] in statuses, f"{variant}: {outcome['message']}"
    assert word in outcome["message"] and "\n" not in outcome["message"], outcome["message"]


def test_the_honest_control_passes_the_search_the_rounds_and_the_audit(worker) -> None:
    outcome = search_then_decision(worker, PLUGIN.HONEST, (32, 4096))
    assert outcome["status"] == Status.PASSED.value, outcome["message"]


@pytest.mark.parametrize("variant", sorted(PLUGIN.DISPATCHER))
def test_a_kernel_registered_over_an_aten_op_is_caught_and_retires_the_worker(
    worker, variant
) -> None:
    """Sealed dispatcher tables: the trial is `suspicious` naming the op, and the next trial
    runs in a fresh worker process (no honest variant is judged by the changed dispatcher)."""
    op = PLUGIN.DISPATCHER[variant]
    cell = cpu_cell("rmsnorm", (8, 256))
    honest = worker.run(TrialTask(cell, "builtin", {}, timing=FAST), 300)
    assert honest["status"] == Status.PASSED.value, honest["message"]
    before = worker.pid
    outcome = search_then_decision(worker, variant, (8, 256))
    assert outcome["status"] == Status.SUSPICIOUS.value, f"{variant}: {outcome['message']}"
    assert "sealed dispatcher table" in outcome["message"] and op in outcome["message"]
    assert worker.pid is None, "the worker that ran the cheat was kept"
    after = worker.run(TrialTask(cell, "builtin", {}, timing=FAST), 300)
    assert after["status"] == Status.PASSED.value, after["message"]
    assert worker.pid not in (None, before)


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    """Notes the name of every ATen op dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        overload = "" if func._overloadname == "default" else f".{func._overloadname}"
        self.names.add(func._schema.name.removeprefix("aten::") + overload)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "add_rmsnorm", "add_layernorm"])
def test_the_sealed_ops_cover_what_the_references_the_builtins_and_the_value_check_use(op):
    spec = get_op(op)
    inputs = spec.make_inputs((4, 64), torch.float32, torch.device("cpu"), 0)
    seen = _Dispatched()
    with seen:
        references = spec.reference(inputs)
        for name in ("naive", "builtin"):
            outputs = spec.as_outputs(get_variant(op, name).factory("cpu")(*inputs))
            check_values(outputs, references, spec, tensors_in(inputs)[0],
                         spec.tolerance(torch.float32))
    assert seen.names <= set(integrity.DISPATCHED_OPS), seen.names - set(integrity.DISPATCHED_OPS)


@pytest.fixture
def busy():
    """A spinning process on every core this process may run on."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in os.sched_getaffinity(0)]
    yield
    for process in spin:
        process.kill()
        process.wait()


def test_an_audit_disturbed_in_every_attempt_leaves_an_honest_contender_unjudged(busy) -> None:
    """Beside a busy process on every core, the honest naive chain decided at a tenth of its
    latency is audited slower than the inconsistent ratio in every attempt: `unjudged`, with
    the disturbance named, never `inconsistent`."""
    cell = cpu_cell("rmsnorm", (64, 1024))
    task = RoundsTask(cell, [("naive", "naive", {})], "warm", StopRule(min_rounds=0,
                      max_rounds=0), timing=FAST, decided_ms={"naive": 1e-3})
    outcome = task.run().contenders["naive"]
    assert outcome.status is Status.UNJUDGED, outcome.message
    assert "disturbed all 3 of its audited timings" in outcome.message, outcome.message

"""The gate's rules as named objects (measure/rules.py): the registry, switching one off by name
for benchmarks/rule_removal.py, and that a plugin cannot switch one off for itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import PLUGINS, cpu_cell

from fusionlab.measure import rules
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import Status, TrialRecord

PLACES = {rules.FIRST_CALL, rules.LOOP, rules.REFILL, rules.LIMITS, rules.PROFILER, rules.AUDIT,
          rules.WORKER}
FAST = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=5, max_samples=20)


def _python(code: str, disabled: str | None) -> subprocess.CompletedProcess[str]:
    """`code` run by a fresh interpreter whose environment switches `disabled` off."""
    env = {k: v for k, v in os.environ.items() if k != rules.ENVIRONMENT}
    if disabled is not None:
        env[rules.ENVIRONMENT] = disabled
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_every_rule_is_named_once_with_what_it_checks_its_status_and_where() -> None:
    assert len(rules.RULES) >= 30
    for name, rule in rules.RULES.items():
        assert rule.name == name and name.isidentifier()
        assert rule.checks and "\n" not in rule.checks
        assert isinstance(rule.status, Status) and rule.status is not Status.PASSED
        assert set(rule.where.split(", ")) <= PLACES, rule.where
        assert rule.enabled  # this test process switches none off
    assert rules.warning() is None
    with pytest.raises(KeyError):
        rules.on("no such rule")
    with pytest.raises(TypeError):
        rules.RULES["error_bound"] = rules.RULES["refill"]  # type: ignore[index]


def test_a_rule_is_switched_off_by_name_once_at_import() -> None:
    done = _python(
        "import os\n"
        "from fusionlab.measure import rules\n"
        f"os.environ[{rules.ENVIRONMENT!r}] = ''\n"  # set after import: changes nothing
        "print(rules.on('error_bound'), rules.on('refill'), rules.on('entropy_bound'))\n"
        "print(rules.warning())\n",
        "error_bound,entropy_bound,nonsense",
    )
    assert done.returncode == 0, done.stderr
    switched, warning = done.stdout.splitlines()
    assert switched == "False True True"  # entropy_bound is not switchable by name
    assert warning.startswith("warning: gate rules switched off by FUSIONLAB_DISABLE_RULES")
    assert "error_bound;" in warning and "switched off: entropy_bound, nonsense)" in warning


def test_a_rule_switched_off_lets_its_cheat_through_and_the_worker_warns_once() -> None:
    """The hook is real: with the value rule off, wrong values pass, and starting workers prints
    one warning line naming the rule."""
    done = _python(
        "from fusionlab.cell import Cell\n"
        "from fusionlab.measure.timing import TimingSettings\n"
        "from fusionlab.measure.trial import TrialTask, run_trial\n"
        "from fusionlab.measure.worker import TrialWorker\n"
        "from fusionlab.registry import load_plugin\n"
        f"load_plugin({str(PLUGINS / 'rule_breakers.py')!r})\n"
        "TrialWorker().close(); TrialWorker().close()\n"
        "timing = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=5, max_samples=20)\n"
        "cell = Cell('rmsnorm', 'cpu', 'test-cpu', (4, 96), 'float32')\n"
        "task = TrialTask(cell, 'rb-off-by-eps', {}, 11, timing)\n"
        "print(run_trial(task).status.value)\n",
        "error_bound",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["passed"]
    warnings = [line for line in done.stderr.splitlines() if "gate rules switched off" in line]
    assert len(warnings) == 1 and "error_bound" in warnings[0]


def test_a_plugin_that_sets_the_variable_switches_nothing_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plugin sets FUSIONLAB_DISABLE_RULES as it loads, here and in the worker: the worker
    starts with the value this process read at import, and reads it before any plugin loads."""
    monkeypatch.delenv(rules.ENVIRONMENT, raising=False)  # restored after the plugin set it
    plugin = str(PLUGINS / "disables_rules.py")
    from fusionlab.registry import load_plugin

    load_plugin(plugin)
    assert os.environ[rules.ENVIRONMENT] == "error_bound" and rules.on("error_bound")
    task = TrialTask(cpu_cell("rmsnorm", (4, 96)), "dr-off-by-eps", {}, seed=11, timing=FAST)
    with TrialWorker([plugin]) as worker:
        record = TrialRecord.from_dict(worker.run(task, 300))
    assert record.status is Status.INCORRECT, (record.status, record.message)
    assert "exceeds atol=" in record.message


def test_a_plugin_that_rebinds_the_registry_or_replaces_the_switch_is_seen() -> None:
    """In a fresh process (what the audit hook notes stays for good): a new `RULES` changes
    nothing, a replaced default of `rules.on` is noted by the hook, a replaced `rules.on` by
    the seal."""
    done = _python(
        "from fusionlab.measure import events, integrity, rules\n"
        "events.install(); integrity.seal()\n"
        "rules.RULES = {}\n"
        "print(rules.on('error_bound'))\n"
        "rules.on.__defaults__ = ({},)\n"
        "print(events.tampered())\n"
        "rules.on = lambda name: False\n"
        "print(integrity.replaced())\n",
        None,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "True", "object.__setattr__ (on.__defaults__)", "fusionlab.measure.rules.on"]

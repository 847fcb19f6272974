"""Isolation: a crashing or hanging variant is recorded and the worker is replaced."""

from conftest import PLUGINS

from fusionlab.records import Status
from fusionlab.registry import load_plugin
from fusionlab.timing import TimingSettings
from fusionlab.trial import TrialTask
from fusionlab.worker import TrialWorker

PLUGIN = str(PLUGINS / "misbehaving.py")

FAST = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=5, max_samples=20)


def _task(variant: str) -> TrialTask:
    return TrialTask("rmsnorm", variant, {}, "cpu", "test-cpu", (2, 64), "float32", timing=FAST)


def test_abort_and_hang_are_recorded_and_the_worker_comes_back() -> None:
    load_plugin(PLUGIN)
    with TrialWorker([PLUGIN]) as worker:
        crashed = worker.run(_task("aborts"), timeout_s=60)
        assert crashed.status is Status.CRASHED and "SIGABRT" in crashed.message
        hung = worker.run(_task("hangs"), timeout_s=3)
        assert hung.status is Status.TIMEOUT and "3 s" in hung.message
        after = worker.run(_task("naive"), timeout_s=60)
        assert after.status is Status.PASSED and after.timing is not None

"""Isolation: a crashing or hanging variant is recorded and the worker is replaced."""

from conftest import PLUGINS, cpu_cell
from helpers import TRIAL_TIMING as FAST

from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import Status, TrialRecord
from fusionlab.registry import load_plugin

PLUGIN = str(PLUGINS / "misbehaving.py")


def _task(variant: str) -> TrialTask:
    return TrialTask(cpu_cell("rmsnorm", (2, 64)), variant, {}, timing=FAST)


def _run(worker: TrialWorker, variant: str, timeout_s: float) -> TrialRecord:
    return TrialRecord.from_dict(worker.run(_task(variant), timeout_s))


def test_abort_and_hang_are_recorded_and_the_worker_comes_back() -> None:
    load_plugin(PLUGIN)
    with TrialWorker([PLUGIN]) as worker:
        crashed = _run(worker, "aborts", 60)
        assert crashed.status is Status.CRASHED and "SIGABRT" in crashed.message
        hung = _run(worker, "hangs", 3)
        assert hung.status is Status.TIMEOUT and "3 s" in hung.message
        after = _run(worker, "naive", 60)
        assert after.status is Status.PASSED and after.timing is not None

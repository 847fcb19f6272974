"""Noticing a busy machine: a real busy-loop process on every core beside a trial is seen; the
trial's own threads are never counted as a disturbance."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import cpu_cell

from fusionlab.devices import get_device
from fusionlab.measure import disturbance
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import TrialTask, copy_limit, run_trial

FAST = TimingSettings(warmup_s=0.01, budget_s=0.3, min_samples=5, max_samples=200)
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")


@pytest.fixture
def hogs() -> Iterator[None]:
    """One busy-loop process per core this process may use, for the length of the test."""
    cores = len(os.sched_getaffinity(0))
    started = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)
    ]
    time.sleep(0.5)  # let them start and spin
    try:
        yield
    finally:
        for process in started:
            process.kill()
            process.wait()


def _others_share_now(seconds: float = 0.5) -> float:
    watch = disturbance.Watch()
    time.sleep(seconds)
    seen = watch.stop()
    assert seen is not None
    return seen.other_share


def test_a_cpu_hog_beside_a_trial_is_noticed(hogs: None) -> None:
    record = run_trial(TrialTask(cpu_cell("rmsnorm", (64, 1024)), "builtin", {}, timing=FAST))
    seen = record.disturbance
    assert seen is not None and seen.disturbed, seen
    assert seen.other_share > disturbance.BUSY_SHARE
    assert seen.other_cpu_s > 0 and seen.load > 0
    line = disturbance.summary([seen])
    assert line is not None and "the machine was busy" in line


def test_a_copy_limit_measured_beside_a_hog_is_marked_busy(hogs: None) -> None:
    limit = copy_limit(get_device("cpu"), torch.float32, 3 * 1024 * 1024 + 4096, cold=False)
    assert disturbance.BUSY_NOTE in limit.note


def test_a_trial_alone_is_quiet_and_its_own_threads_do_not_count() -> None:
    before = _others_share_now()
    if before > disturbance.BUSY_SHARE / 2:
        pytest.skip(f"the machine is busy already (others use {100 * before:.0f}% of its cores)")
    record = run_trial(TrialTask(cpu_cell("rmsnorm", (64, 1024)), "builtin", {}, timing=FAST))
    seen = record.disturbance
    assert seen is not None and not seen.disturbed, seen
    assert disturbance.summary([seen]) is None


def test_own_work_is_not_counted_as_others() -> None:
    # This process spins for 0.5 s: busy cores, but none of it is another process's.
    before = _others_share_now()
    watch = disturbance.Watch()
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        pass
    seen = watch.stop()
    assert seen is not None
    # At most what others were using anyway (plus /proc/stat's tick rounding), never our spin.
    assert seen.other_share <= max(before, 0.0) + 0.2, (before, seen)

"""The `compiled` variants compile their forward and backward graphs in their first, untimed
call, and the audit makes an untimed call on one thread before its one-thread retry, so no
compile lands inside a measured window, where the audit hook sees it and marks the variant
suspicious."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from helpers import sqlite_url

from fusionlab.records import Status
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage

# Builds rmsnorm's compiled variant as a trial does (first call included) on 2 threads, then
# audits it against a decision far faster than it can run, so the audit re-times it, the last
# time on one thread, and ends `inconsistent` (or `unjudged` on a busy machine) unless the gate
# saw something while it timed.
_AUDIT_WITH_RETRIES = """
import sys, torch
from fusionlab.measure import events
from fusionlab.measure.audit import audit, fresh_sets
from fusionlab.measure.correctness import GateFailure
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import build_and_gate
from fusionlab.cell import Cell
events.install()
torch.set_num_threads(2)
cell = Cell(op="rmsnorm", device="cpu", device_name="cpu", shape=(8, 256), dtype="float32",
            pass_name=sys.argv[1])
m, *_ = build_and_gate(cell, "compiled", {"mode": "default", "dynamic": False}, 0)
settings = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=3, max_samples=5)
try:
    audit(m, "warm", settings, 1e-9, fresh_sets(m))
    print("passed")
except GateFailure as failure:
    print(failure.status.value, failure)
"""


def _audit_with_retries(pass_name: str) -> str:
    done = subprocess.run([sys.executable, "-c", _AUDIT_WITH_RETRIES, pass_name],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("pass_name", ["forward", "forward+backward", "backward"])
def test_the_audits_one_thread_retry_compiles_nothing_inside_its_window(pass_name) -> None:
    """Without the audit's untimed one-thread call, the one-thread graphs compile inside the
    retry's timed loop and the gate calls the variant suspicious."""
    status = _audit_with_retries(pass_name).split()[0]
    assert status in (Status.INCONSISTENT.value, Status.UNJUDGED.value), status


def test_a_one_thread_compiled_sweep_has_no_suspicious_configuration(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "compiled.db")
    done = run_cli("sweep", "rmsnorm", "--quick", "--shapes", "8x256", "--variants", "compiled",
                   "--pass", "forward+backward", "--threads", "1", "--storage", url,
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    cells = load_cells(open_storage(url, must_exist=True, read_only=True), "rmsnorm")
    records = [record for cell in cells for record in cell.records]
    assert {record.params["dynamic"] for record in records} == {False, True}
    assert all(record.passed for record in records), [
        (record.params, record.status, record.message) for record in records]

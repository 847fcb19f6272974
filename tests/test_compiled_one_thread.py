"""The `compiled` variants compile every graph in their first, untimed call: forward, backward
where the pass has one, and the graph for one thread (the audit's serial retry), so no compile
lands inside a measured window, where the audit hook sees it and marks the variant suspicious."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from fusionlab.records import Status
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage

# Builds rmsnorm's compiled variant as a trial does (first call included) on 2 threads, then
# times it as the audit's retry does: on one thread, under the gate. "raw" swaps in the
# torch.compile'd function without the first call's warm-up, built and called once the same way.
_RETRY_ON_ONE_THREAD = """
import dataclasses, sys, torch
from fusionlab.measure import events
from fusionlab.measure.correctness import GateFailure
from fusionlab.measure.inputs import WARM_SETS, serial
from fusionlab.measure.passes import as_pass
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import build_and_gate, timed_and_checked
from fusionlab.cell import Cell
from fusionlab.registry import get_op, get_variant
events.install()
torch.set_num_threads(2)
pass_name, which = sys.argv[1], sys.argv[2]
cell = Cell(op="rmsnorm", device="cpu", device_name="cpu", shape=(8, 256), dtype="float32",
            pass_name=pass_name)
params = {"mode": "default", "dynamic": False}
m, *_ = build_and_gate(cell, "compiled", params, 0)
if which == "raw":
    torch._dynamo.reset()
    raw = get_variant("rmsnorm", "compiled").factory("cpu", **params).compiled
    m = dataclasses.replace(m, kernel=as_pass(raw, get_op("rmsnorm"), pass_name))
    m.kernel(*m.sets.sets[0])  # the first call, on 2 threads
settings = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=3, max_samples=5)
with serial():
    try:
        timed_and_checked(dataclasses.replace(m, threads=1), WARM_SETS, settings, cold=False)
        print("passed")
    except GateFailure as failure:
        print(failure.status.value, failure)
"""


def _retry_on_one_thread(pass_name: str, which: str) -> str:
    done = subprocess.run([sys.executable, "-c", _RETRY_ON_ONE_THREAD, pass_name, which],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_audits_one_thread_retry_compiles_nothing() -> None:
    """Without the warm-up the one-thread graphs compile inside the timed loop and the gate calls
    the variant suspicious; with it, the same loop passes."""
    assert _retry_on_one_thread("forward+backward", "warm") == "passed"
    assert _retry_on_one_thread("forward+backward", "raw").startswith(Status.SUSPICIOUS.value)
    assert _retry_on_one_thread("backward", "warm") == "passed"


def test_a_one_thread_compiled_sweep_has_no_suspicious_configuration(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'compiled.db'}"
    done = run_cli("sweep", "rmsnorm", "--quick", "--shapes", "8x256", "--variants", "compiled",
                   "--pass", "forward+backward", "--threads", "1", "--storage", url,
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    cells = load_cells(open_storage(url, must_exist=True, read_only=True), "rmsnorm")
    records = [record for cell in cells for record in cell.records]
    assert {record.params["dynamic"] for record in records} == {False, True}
    assert all(record.passed for record in records), [
        (record.params, record.status, record.message) for record in records]

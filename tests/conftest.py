"""Shared test helpers. Triton kernels run in its CPU interpreter; there is no GPU in CI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import GATE_TIMING, sqlite_url

from fusionlab.cell import Cell
from fusionlab.measure.rounds import RoundsTask, StopRule
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import Status
from fusionlab.schema import plain

os.environ.setdefault("TRITON_INTERPRET", "1")

PLUGINS = Path(__file__).parent / "plugins"


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real `fusionlab` command in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "fusionlab.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
    )


def probe_sweep(tmp_path: Path, url: str, probe: str, *extra: str) -> str:
    """A quick sweep of the `probe`-probe variant (tests/plugins/`probe`_probe.py, which writes
    what its measuring process sees) and builtin at 4x256; its stderr."""
    plugin = str(PLUGINS / f"{probe}_probe.py")
    result = run_cli("sweep", "rmsnorm", "--quick", "--shapes", "4x256", "--variants",
                     f"{probe}-probe,builtin", "--plugin", plugin, "--storage", url, *extra,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr


def interruptible() -> None:
    """Popen's preexec_fn for a command the test stops with SIGINT, as a terminal's Ctrl-C does:
    a shell that starts the tests in the background hands them SIGINT ignored, and Python then
    never turns SIGINT into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def storage_url(tmp_path: Path) -> str:
    return sqlite_url(tmp_path / "results.db")


def cpu_cell(op: str, shape: tuple[int, ...], dtype: str = "float32") -> Cell:
    """A cell on this machine's CPU, for trials run in the test process."""
    return Cell(op, "cpu", "test-cpu", shape, dtype)


def search_then_decision(worker: TrialWorker, variant: str,
                         shape: tuple[int, ...] = (8, 256)) -> dict:
    """An rmsnorm `variant`'s search trial in `worker`; if it passes, the cell's rounds and audit
    beside the built-in: the record whose status and message a cheat earns."""
    cell = cpu_cell("rmsnorm", shape)
    record = worker.run(TrialTask(cell, variant, {}, seed=2, timing=GATE_TIMING), 300)
    if record["status"] != Status.PASSED.value:
        return record
    task = RoundsTask(cell, [("candidate", variant, {}), ("builtin", "builtin", {})], "warm",
                      StopRule(min_rounds=2, max_rounds=2), timing=GATE_TIMING,
                      decided_ms={"candidate": record["timing"]["median_ms"]})
    return plain(worker.run(task, 600).contenders["candidate"])

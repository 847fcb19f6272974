"""Shared test helpers. Triton kernels run in its CPU interpreter; there is no GPU in CI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import sqlite_url

from fusionlab.cell import Cell

os.environ.setdefault("TRITON_INTERPRET", "1")

PLUGINS = Path(__file__).parent / "plugins"


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run the real `fusionlab` command in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "fusionlab.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
    )


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

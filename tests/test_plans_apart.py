"""Sweeps kept apart: two sweeps started at once on one storage, of one cell with different
variants or of one op with different shapes, each measure exactly their own plan with their own
workers, and each prints only what it asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import PLUGINS
from helpers import finished_trials

SLOW = str(PLUGINS / "slow_variants.py")


def _start(url: str, cwd: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "fusionlab.cli", "sweep", "rmsnorm", "--quick",
               "--plugin", SLOW, "--workers", "2", "--storage", url, *args]
    env = {**os.environ, "FUSIONLAB_TEST_SETUP_S": "0.5"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _both(tmp_path: Path, first: tuple[str, ...], second: tuple[str, ...],
          configs: int) -> list[tuple[str, str]]:
    """Two sweeps started at once on one journal, each a success: their (stdout, stderr).
    Between them they measured `configs` configurations, each exactly once."""
    url = f"journal:{tmp_path / 'shared.journal'}"
    runs = [_start(url, tmp_path, *first), _start(url, tmp_path, *second)]
    outputs = [run.communicate(timeout=900) for run in runs]
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-3000:]
    counts = finished_trials(url)
    assert len(counts) == configs and set(counts.values()) == {1}, counts
    return outputs


def _assert_progress(err: str, lines: int, needle: str, present: bool = True) -> None:
    """`err` has `lines` progress lines, each with `needle` in it (or each without)."""
    progress = [line for line in err.splitlines() if line.startswith("worker ") and "] " in line]
    assert len(progress) == lines, err[-3000:]
    assert all((needle in line) == present for line in progress), err[-3000:]


def _fastest(table: str) -> list[str]:
    """The `fastest` column of a printed table (shape, dtype, fastest, ...)."""
    return [line.split()[2] for line in table.splitlines() if line.startswith("4x256 ")]


def test_two_sweeps_of_one_cell_with_different_variants_each_measure_their_own(
        tmp_path: Path) -> None:
    (out_a, err_a), (out_b, err_b) = _both(
        tmp_path, ("--shapes", "4x256", "--variants", "slow-setup"),
        ("--shapes", "4x256", "--variants", "builtin,naive"), configs=8)
    _assert_progress(err_a, 6, "slow-setup")
    _assert_progress(err_b, 2, "slow-setup", present=False)
    assert _fastest(out_a) == ["slow-setup"]  # each prints the winner of what it asked for
    assert _fastest(out_b)[0] in ("builtin", "naive") and "slow-setup" not in out_b


def test_two_sweeps_of_one_op_with_different_shapes_each_measure_their_own(
        tmp_path: Path) -> None:
    (_, err_a), (_, err_b) = _both(
        tmp_path, ("--shapes", "4x256", "--variants", "slow-setup"),
        ("--shapes", "8x256", "--variants", "slow-setup"), configs=12)
    for err, shape in ((err_a, " 4x256 "), (err_b, " 8x256 ")):
        _assert_progress(err, 6, shape)

"""Sweeps kept apart: two sweeps started at once on one storage, of one cell with different
variants or of one op with different shapes, each measure exactly their own plan with their own
workers, and each prints only what it asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import optuna
from conftest import PLUGINS

from fusionlab.search import claims
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage

SLOW = str(PLUGINS / "slow_variants.py")


def _start(url: str, cwd: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "fusionlab.cli", "sweep", "rmsnorm", "--quick",
               "--plugin", SLOW, "--workers", "2", "--storage", url, *args]
    env = {**os.environ, "FUSIONLAB_TEST_SETUP_S": "0.5"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _both(url: str, cwd: Path, first: tuple[str, ...], second: tuple[str, ...]):
    runs = [_start(url, cwd, *first), _start(url, cwd, *second)]
    outputs = [run.communicate(timeout=900) for run in runs]
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-3000:]
    return outputs


def _progress(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("worker ") and "] " in line]


def _fastest(table: str) -> list[str]:
    """The `fastest` column of a printed table (shape, dtype, fastest, ...)."""
    return [line.split()[2] for line in table.splitlines() if line.startswith("4x256 ")]


def _finished(url: str) -> Counter[tuple[str, str]]:
    """(study, configuration) -> how many finished trials measured it."""
    storage = open_storage(url, must_exist=True)
    counts: Counter[tuple[str, str]] = Counter()
    for name in optuna.get_all_study_names(storage):
        study = optuna.load_study(study_name=name, storage=storage)
        for trial in study.get_trials(deepcopy=False, states=(
                optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)):
            key = trial.user_attrs.get(claims.CONFIG)
            if key is not None and not store.is_verdict_key(key):
                counts[(name, key)] += 1
    return counts


def test_two_sweeps_of_one_cell_with_different_variants_each_measure_their_own(
        tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'shared.journal'}"
    (out_a, err_a), (out_b, err_b) = _both(
        url, tmp_path, ("--shapes", "4x256", "--variants", "slow-setup"),
        ("--shapes", "4x256", "--variants", "builtin,naive"))
    mine_a, mine_b = _progress(err_a), _progress(err_b)
    assert len(mine_a) == 6 and all("slow-setup" in line for line in mine_a), err_a[-3000:]
    assert len(mine_b) == 2 and not any("slow-setup" in line for line in mine_b), err_b[-3000:]
    assert _fastest(out_a) == ["slow-setup"]  # each prints the winner of what it asked for
    assert _fastest(out_b)[0] in ("builtin", "naive") and "slow-setup" not in out_b
    counts = _finished(url)
    assert len(counts) == 8 and set(counts.values()) == {1}, counts


def test_two_sweeps_of_one_op_with_different_shapes_each_measure_their_own(
        tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'shared.journal'}"
    (_, err_a), (_, err_b) = _both(
        url, tmp_path, ("--shapes", "4x256", "--variants", "slow-setup"),
        ("--shapes", "8x256", "--variants", "slow-setup"))
    mine_a, mine_b = _progress(err_a), _progress(err_b)
    assert len(mine_a) == 6 and all(" 4x256 " in line for line in mine_a), err_a[-3000:]
    assert len(mine_b) == 6 and all(" 8x256 " in line for line in mine_b), err_b[-3000:]
    counts = _finished(url)
    assert len(counts) == 12 and set(counts.values()) == {1}, counts

"""README claims run the way a user runs them, with the real `fusionlab` command: Ctrl-C on
`sweep --workers N`, `--rank-by warm`, `--calls N` and `--seed`, `fusionlab profile`, and an
edited built-in kernel source starting new cells."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
from conftest import PLUGINS, run_cli
from helpers import sqlite_url
from optuna.trial import TrialState

from fusionlab.api import stored_cells
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage

ROOT = Path(__file__).resolve().parents[1]
COSTS = str(PLUGINS / "first_use_costs.py")
SLOW = str(PLUGINS / "slow_variants.py")


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_rank_by_warm_calls_and_seed_from_the_command_line(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "r.db")
    args = ["sweep", "rmsnorm", "--quick", "--shapes", "2x64", "--dtypes", "float32",
            "--plugin", COSTS, "--variants", "slow-first-use,padded", "--storage", url]
    warm = run_cli(*args, "--rank-by", "warm", "--seed", "5", "--export", "warm.csv",
                   cwd=tmp_path)
    assert warm.returncode == 0, warm.stderr
    assert "ranked by the warm median" in warm.stdout
    (row,) = _rows(tmp_path / "warm.csv")
    # Ranked by latency, the variant without the 0.5 ms padding wins; the median shown is the
    # warm one.
    assert row["fastest"] == "slow-first-use", row
    assert row["median ms"] == row["warm ms"] != row["cold ms"], row
    (cell,) = stored_cells("rmsnorm", url)
    assert {r.seed for r in cell.records} == {5} and len(cell.records) == 2
    assert set(cell.verdicts) == {"warm"}

    # The same storage ranked by first use + 1000 calls: nothing is measured again, and the
    # 3 s setup outweighs 1000 x 0.5 ms of padding.
    costed = run_cli(*args, "--rank-by", "warm", "--seed", "5", "--calls", "1000",
                     "--export", "calls.csv", cwd=tmp_path)
    assert costed.returncode == 0, costed.stderr
    assert "] 2x64" not in costed.stderr  # no progress line: nothing measured
    assert "ranked by first use + 1000 x warm latency" in costed.stdout
    (row,) = _rows(tmp_path / "calls.csv")
    assert row["fastest"] == "padded" and row["decision"] == "by cost", row


def test_profile_one_variant_in_depth(tmp_path: Path) -> None:
    result = run_cli("profile", "rmsnorm", "--variant", "naive", "--shape", "32x4096",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "== naive ==" in out and "Self CPU" in out
    assert "naive: 6 device ops per call (aten::mul x3)" in out
    assert "3 x aten::mul" in out and "1 x aten::rsqrt" in out
    assert "setup" in out and "first call" in out and "median" in out


_STUDY_NAME = """
from fusionlab.plan import make_plan
from fusionlab.search.results_store import study_name
import fusionlab
print(fusionlab.__file__)
for op in ("rmsnorm", "layernorm"):
    print(study_name(make_plan(op, "4x64", "float32", "cpu").cells()[0]))
"""


def _study_names(tree: Path) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run([sys.executable, "-c", _STUDY_NAME], cwd=tree.parent, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    where, rmsnorm, layernorm = result.stdout.splitlines()
    assert Path(where).is_relative_to(tree), where  # the copy, not the checkout, ran
    return rmsnorm, layernorm


def test_editing_a_builtin_kernel_source_starts_new_cells(tmp_path: Path) -> None:
    tree = tmp_path / "checkout"
    for folder in ("fusionlab", "kernels", "search"):
        shutil.copytree(ROOT / folder, tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    before = _study_names(tree)
    assert _study_names(tree) == before  # stable while nothing changes
    source = tree / "kernels" / "rmsnorm" / "csrc" / "rmsnorm_cpu.cpp"
    source.write_text(source.read_text() + "\n// a kernel edit\n")
    rmsnorm, layernorm = _study_names(tree)
    assert rmsnorm != before[0], "an edited rmsnorm kernel kept its old cells"
    assert layernorm == before[1], "another op's cells changed with it"


def _running(url: str, searching: bool = False) -> list[str]:
    """The workers of the trials now RUNNING (`searching`: search trials only, not a cell's
    re-measurement)."""
    try:
        storage = open_storage(url, must_exist=True)
    except Exception:
        return []
    return [
        t.user_attrs.get("worker", "")
        for cell, _ in store.planned_cells(storage)
        for t in optuna.load_study(study_name=store.study_name(cell), storage=storage)
        .get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not (searching and store.is_verdict_key(t.user_attrs.get("config", "")))
    ]


def _mid_search(url: str) -> bool:
    """Two search trials running at once, with one not yet claimed after them: a Ctrl-C now
    must leave the search unfinished."""
    return (len(set(_running(url, searching=True))) == 2
            and sum(_measured(url).values()) + 2 < 14)


def _measured(url: str) -> Counter:
    storage = open_storage(url, must_exist=True)
    return Counter(
        (cell.op, cell.shape, t.user_attrs["config"])
        for cell, _ in store.planned_cells(storage)
        for t in optuna.load_study(study_name=store.study_name(cell), storage=storage)
        .get_trials(deepcopy=False)
        if store.RECORD_ATTR in t.user_attrs
        and not store.is_verdict_key(t.user_attrs.get("config", ""))
    )


def _own_group_interruptible() -> None:
    """The command and its workers in a process group of their own, as a terminal's foreground
    job is, with SIGINT at its default (a background shell hands it ignored)."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_sweep_with_workers_stops_them_all_and_the_same_command_resumes(
    tmp_path: Path,
) -> None:
    url = f"journal:{tmp_path / 'sweep.log'}"
    args = ["sweep", "rmsnorm", "--quick", "--shapes", "2x64,4x128", "--plugin", SLOW,
            "--variants", "naive,slow-setup", "--storage", url, "--workers", "2"]
    env = {**os.environ, "FUSIONLAB_TEST_SETUP_S": "1.5"}
    sweep = subprocess.Popen([sys.executable, "-m", "fusionlab.cli", *args], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_own_group_interruptible)
    try:
        # Ctrl-C while both workers measure search trials and one is still unclaimed (their
        # trial workers ignore SIGINT from their start: Ctrl-C is the parent's to handle,
        # fusionlab/measure/worker.py). Two running in the cells' re-measurement, or the last two
        # of the search, would let the search end whole.
        deadline = time.monotonic() + 300
        while not (mid := _mid_search(url)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mid, "the two workers never measured search trials at once"
        os.killpg(sweep.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        _, err = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert not _running(url), "a claim was left RUNNING for its lease to expire"
    partial = _measured(url)
    assert all(n == 1 for n in partial.values()) and sum(partial.values()) < 14, partial
    resumed = run_cli(*args, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    done = _measured(url)
    assert len(done) == 14 and all(n == 1 for n in done.values()), done
    assert all(done[key] == 1 for key in partial)  # nothing measured before was measured again

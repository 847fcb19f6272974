"""Sweeps over many real worker processes on one storage (real PostgreSQL and journal files):
every configuration measured exactly once, a SIGKILLed worker's claim finished by another,
`fusionlab worker` joining a planned sweep, `fusionlab status`, and refusals of what cannot work."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from conftest import interruptible
from helpers import sqlite_url
from optuna.trial import TrialState
from pg_cluster import fresh_postgres_url, postgres_url  # noqa: F401  (fixtures)

from fusionlab.search import claims
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage

PLUGIN = str(Path(__file__).parent / "plugins" / "slow_variants.py")
SWEEP = ["sweep", "rmsnorm", "--quick", "--shapes", "2x64,4x128", "--plugin", PLUGIN]
SWEEP += ["--variants", "naive,slow-setup"]
CONFIGS_PER_CELL = 7  # naive + slow-setup's six copies


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "FUSIONLAB_TEST_SETUP_S": "0.3", **extra}


def _fusionlab(*args: str, env: dict[str, str] | None = None, timeout: float = 400):
    return subprocess.run(
        [sys.executable, "-m", "fusionlab.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _env(),
        check=False,
    )


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fusionlab.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or _env(),
        preexec_fn=interruptible,
    )


@pytest.fixture(params=["postgres", "journal"])
def url(request, tmp_path) -> str:
    if request.param == "journal":
        return f"journal:{tmp_path / 'sweep.log'}"
    return request.getfixturevalue("fresh_postgres_url")


def _cells(url: str) -> list[optuna.Study]:
    storage = open_storage(url, must_exist=True)
    return [
        optuna.load_study(study_name=store.study_name(cell), storage=storage)
        for cell, _ in store.planned_cells(storage)
    ]


def _measured(study: optuna.Study) -> Counter:
    """How many records each configuration has in a cell."""
    return Counter(
        t.user_attrs["config"]
        for t in study.get_trials(deepcopy=False)
        if store.RECORD_ATTR in t.user_attrs
    )


def _config_sets(url: str) -> dict[str, Counter]:
    return {s.study_name: _measured(s) for s in _cells(url)}


def _measured_by_worker(url: str) -> Counter:
    """How many configurations (re-measurements aside) each worker's records hold."""
    return Counter(
        t.user_attrs["worker"]
        for study in _cells(url)
        for t in study.get_trials(deepcopy=False)
        if store.RECORD_ATTR in t.user_attrs
        and not store.is_verdict_key(t.user_attrs.get("config", ""))
    )


def _done_lines(stderr: str) -> dict[str, int]:
    """worker name -> configurations it says it measured, from "worker H:P: done, ..." lines."""
    found = re.findall(r"^worker (\S+): done, measured (\d+) configurations$", stderr, re.M)
    return {name: int(count) for name, count in found}


@pytest.fixture(scope="module")
def one_worker_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Each cell's configurations as one worker's sweep measures them, shared by both storages."""
    alone = f"journal:{tmp_path_factory.mktemp('alone') / 'alone.log'}"
    single = _fusionlab(*SWEEP, "--storage", alone)
    assert single.returncode == 0, single.stderr
    return {name: set(counts) for name, counts in _config_sets(alone).items()}


def test_workers_measure_the_one_worker_configuration_set_once(
        url: str, one_worker_configs: dict[str, set[str]]) -> None:
    # Setups long enough that a worker whose start lags by seconds on a loaded machine still
    # finds configurations left to claim.
    many = _fusionlab(*SWEEP, "--storage", url, "--workers", "3",
                      env=_env(FUSIONLAB_TEST_SETUP_S="1.0"))
    assert many.returncode == 0, many.stderr
    got = _config_sets(url)
    assert {name: set(counts) for name, counts in got.items()} == one_worker_configs
    assert all(n == 1 for counts in got.values() for n in counts.values()), got
    assert all(len(counts) == CONFIGS_PER_CELL for counts in got.values())
    # Every worker measured: three workers' records are in the storage, each with some, and
    # each worker's own count (its last line) is what the storage holds in its name.
    by_worker = _measured_by_worker(url)
    assert len(by_worker) == 3 and all(n > 0 for n in by_worker.values()), by_worker
    assert sum(by_worker.values()) == 2 * CONFIGS_PER_CELL
    assert _done_lines(many.stderr) == dict(by_worker), many.stderr
    # The table is printed once, by the sweep command.
    assert sum(line.startswith("shape ") for line in many.stdout.splitlines()) == 1
    for study in _cells(url):
        assert study.user_attrs[store.VERDICT_ATTR]["cold"]["winner"]
        # Planners racing may enqueue the re-measurement twice; the claim rule ends the twin
        # unmeasured (duplicate_of, or "decided already" once the first has ended), so exactly
        # one trial of it ran its rounds, and it ended PRUNED (bookkeeping, not a failure).
        verdicts = [
            t for t in study.get_trials(deepcopy=False)
            if store.is_verdict_key(t.user_attrs.get("config", ""))
            and t.user_attrs.get(claims.CLOSED, "").startswith("re-measured: ")
        ]
        assert len(verdicts) == 1, "a cell's re-measurement ran more than once"
        assert verdicts[0].state == TrialState.PRUNED


def _wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _running_workers(url: str) -> set[str]:
    try:
        studies = _cells(url)
    except Exception:
        return set()
    return {
        t.user_attrs.get("worker", "")
        for s in studies
        for t in s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    } - {""}


def test_worker_joins_a_planned_sweep_and_a_sigkilled_one_loses_nothing(url: str) -> None:
    env = _env(FUSIONLAB_LEASE_S="4", FUSIONLAB_TEST_SETUP_S="1.5")
    sweep = _start(*SWEEP, "--storage", url, env=env)
    victim = None
    try:
        _wait_for(lambda: _running_workers(url), what="the sweep's first claim")
        victim = _start("worker", "--storage", url, env=env)
        _wait_for(
            lambda: any(w.endswith(f":{victim.pid}") for w in _running_workers(url)),
            what="the joining worker's first claim",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        _, err = sweep.communicate(timeout=400)
    finally:
        for process in (sweep, victim):
            if process is not None and process.poll() is None:
                process.kill()
    assert sweep.returncode == 0, err
    _assert_killed_claim_taken_over(url, victim.pid)
    _assert_status_shows_every_cell_measured(url)


def _assert_killed_claim_taken_over(url: str, pid: int) -> None:
    """Every configuration measured exactly once; the killed worker's claim taken over when its
    lease expired, its trial pruned without a record, nothing left running or waiting."""
    counts = _config_sets(url)
    assert all(len(c) == CONFIGS_PER_CELL for c in counts.values()), counts
    assert all(n == 1 for c in counts.values() for n in c.values()), counts
    trials = [t for s in _cells(url) for t in s.get_trials(deepcopy=False)]
    taken_over = [t for t in trials if t.user_attrs.get("retry_why") == "lease expired"]
    assert taken_over, "the killed worker's claim was not taken over"
    killed = [t for t in trials if t.state == TrialState.PRUNED
              and t.user_attrs.get("worker", "").endswith(f":{pid}")]
    assert killed and all(store.RECORD_ATTR not in t.user_attrs for t in killed)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def _assert_status_shows_every_cell_measured(url: str) -> None:
    status = _fusionlab("status", "--storage", url)
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines() if "float32" in line]
    assert len(rows) == 2
    for row in rows:  # measured, running, waiting after the dtype column
        at = row.index("float32")
        assert row[at + 1 : at + 4] == [str(CONFIGS_PER_CELL), "-", "0"], row


def test_status_shows_who_is_running_what(url: str) -> None:
    env = _env(FUSIONLAB_TEST_SETUP_S="1.5")
    sweep = _start(*SWEEP, "--storage", url, env=env)
    try:
        _wait_for(lambda: _running_workers(url), what="a claim")
        status = _fusionlab("status", "--storage", url)
    finally:
        sweep.send_signal(signal.SIGINT)
        sweep.communicate(timeout=120)
    assert status.returncode == 0, status.stderr
    assert f":{sweep.pid} (1)" in status.stdout, status.stdout
    assert "2x64 float32" in status.stdout and "4x128 float32" in status.stdout
    # Ctrl-C gave the claim back: nothing is left RUNNING for a lease to expire.
    assert sweep.returncode == 130
    assert not _running_workers(url)


def test_parallel_workers_refuse_sqlite(tmp_path) -> None:
    db = sqlite_url(tmp_path / "f.db")
    result = _fusionlab(*SWEEP, "--storage", db, "--workers", "2")
    assert result.returncode == 2
    assert "SQLite" in result.stderr and "journal:" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "f.db").exists()
    (tmp_path / "g.db").touch()
    joined = _fusionlab("worker", "--storage", sqlite_url(tmp_path / "g.db"))
    assert joined.returncode == 2 and "SQLite" in joined.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--workers", "64", "--pin"], "--pin needs a core per worker"),
    ],
)
def test_bad_worker_counts(tmp_path, args: list[str], needle: str) -> None:
    result = _fusionlab(*SWEEP, "--storage", f"journal:{tmp_path / 'j.log'}", *args)
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert not (tmp_path / "j.log").exists()


def test_worker_with_nothing_planned_says_so(tmp_path) -> None:
    log = tmp_path / "empty.log"
    log.touch()
    result = _fusionlab("worker", "--storage", f"journal:{log}")
    assert result.returncode == 2
    assert "no sweep" in result.stderr and "fusionlab sweep" in result.stderr


def test_workers_share_inductor_cache_so_nothing_compiles_twice(tmp_path) -> None:
    url = f"journal:{tmp_path / 'compile.log'}"
    env = _env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    args = ["sweep", "rmsnorm", "--quick", "--shapes", "2x64,4x128", "--variants", "compiled"]
    first = _fusionlab(*args, "--storage", url, "--workers", "2", env=env)
    assert first.returncode == 0, first.stderr

    def compiles() -> Counter:
        total: Counter = Counter()
        for study in _cells(url):
            for t in study.get_trials(deepcopy=False):
                if store.RECORD_ATTR in t.user_attrs:
                    total.update(t.user_attrs[store.RECORD_ATTR]["compiles"])
        return total

    cold = compiles()
    configs = sum(len(_measured(s)) for s in _cells(url))
    assert configs == 4  # dynamic True/False at two shapes
    # Each configuration is measured by one worker, so each graph is compiled at most once.
    assert 1 <= cold["fxgraph_cache_miss"] <= configs, cold
    again = _fusionlab(*args, "--storage", url, "--workers", "2", "--fresh", env=env)
    assert again.returncode == 0, again.stderr
    warm = compiles()
    assert warm["fxgraph_cache_miss"] == 0 and warm["fxgraph_cache_hit"] >= configs, warm

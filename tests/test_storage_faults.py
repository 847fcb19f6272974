"""Storage faults survived: a real PostgreSQL 15 server is stopped in the middle of a
`--workers 2` sweep and started again; the sweep completes with every configuration measured
exactly once. An outage longer than the retry budget ends in one line, exit 2, and the same
command resumes. This module runs its own cluster (it stops it on purpose)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from conftest import PLUGINS
from helpers import finished_trials
from pg_cluster import PG_BIN, SCRIPT

from fusionlab.search import claims
from fusionlab.search.retry import RetryingStorage, RetryPolicy, StorageUnavailable, is_transient
from fusionlab.search.storage import open_storage

SLOW = str(PLUGINS / "slow_variants.py")
CONFIGS = 6  # slow-setup's `copy` tunable
# A progress line of a measured configuration. Not "[1/": two workers finishing together both
# count 2, and the first line then reads "[2/6]".
FIRST_MEASURED = f"/{CONFIGS}] "


class Cluster:
    """A PostgreSQL cluster of this module's own, which tests may stop and start."""

    def __init__(self, folder: str) -> None:
        self.env = {**os.environ, "FUSIONLAB_PG_DIR": folder}

    def _script(self, command: str) -> str:
        done = subprocess.run([str(SCRIPT), command], env=self.env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def start(self) -> str:
        return self._script("start")

    def pause(self) -> None:
        self._script("pause")

    def resume(self) -> None:
        self._script("resume")

    def stop(self) -> None:
        self._script("stop")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, str]]:
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL server binaries in {PG_BIN} (set PG_BIN or install them)")
    server = Cluster(f"/tmp/fusionlab-pg-faults-{uuid.uuid4().hex[:12]}")
    url = server.start()
    try:
        yield server, url
    finally:
        server.stop()


@pytest.fixture
def database(cluster: tuple[Cluster, str]) -> Iterator[str]:
    """A new database on the module's cluster (the cluster is running again afterwards)."""
    server, url = cluster
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    yield sqlalchemy.engine.make_url(url).set(database=name).render_as_string(hide_password=False)
    if not _up(url):
        server.resume()


def _up(url: str) -> bool:
    engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": 2})
    try:
        with engine.connect():
            return True
    except sqlalchemy.exc.OperationalError:
        return False
    finally:
        engine.dispose()


class Running:
    """A `fusionlab sweep` in the background whose stderr is read line by line as it comes."""

    def __init__(self, url: str, cwd: Path, **env: str) -> None:
        command = [sys.executable, "-m", "fusionlab.cli", "sweep", "rmsnorm", "--quick",
                   "--shapes", "4x256", "--variants", "slow-setup", "--plugin", SLOW,
                   "--workers", "2", "--storage", url]
        self.lines: list[str] = []
        self.process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, "\n".join(self.lines[-30:])
            assert time.monotonic() < deadline, "\n".join(self.lines[-30:])
            time.sleep(0.1)

    def finish(self, timeout: float = 400) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def _finished_per_config(url: str) -> Counter[str]:
    """How many finished (measured) trials each configuration has, over every stored cell."""
    counts: Counter[str] = Counter()
    for (_, config), n in finished_trials(url).items():
        counts[config] += n
    return counts


def test_a_sweep_survives_a_20_second_database_outage(cluster: tuple[Cluster, str],
                                                      database: str, tmp_path: Path) -> None:
    server, _ = cluster
    sweep = Running(database, tmp_path, FUSIONLAB_TEST_SETUP_S="2", FUSIONLAB_LEASE_S="90")
    sweep.wait_for(FIRST_MEASURED)  # the workers are measuring
    server.pause()
    time.sleep(20)
    server.resume()
    code = sweep.finish()
    log = "\n".join(sweep.lines)
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "exited with code" not in log, log[-3000:]
    assert "unreachable" in log and "is back" in log  # the outage did hit the workers
    counts = _finished_per_config(database)
    assert len(counts) == CONFIGS and set(counts.values()) == {1}, counts


def test_a_longer_outage_ends_in_one_line_and_the_sweep_resumes(
        cluster: tuple[Cluster, str], database: str, tmp_path: Path) -> None:
    server, _ = cluster
    # Leases outlast the retry budget (the lost worker gives up first), and the claims it left
    # expire soon after, for the run that resumes.
    env = {"FUSIONLAB_TEST_SETUP_S": "2", "FUSIONLAB_LEASE_S": "12",
           "FUSIONLAB_STORAGE_RETRY_S": "6"}
    sweep = Running(database, tmp_path, **env)
    sweep.wait_for(FIRST_MEASURED)
    server.pause()
    try:
        code = sweep.finish()
    finally:
        server.resume()
    assert code == 2, "\n".join(sweep.lines[-30:])
    last = sweep.lines[-1]
    assert last.startswith("fusionlab: storage ") and "stayed unreachable for 6 s" in last
    assert "run the same command again" in last and "Traceback" not in "\n".join(sweep.lines)
    again = Running(database, tmp_path, **env)
    assert again.finish() == 0, "\n".join(again.lines[-30:])
    counts = _finished_per_config(database)
    assert len(counts) == CONFIGS and set(counts.values()) == {1}, counts


def test_storage_calls_wait_for_the_server_and_give_up_after_the_budget(
        cluster: tuple[Cluster, str], database: str) -> None:
    server, _ = cluster
    storage = open_storage(database)
    assert isinstance(storage, RetryingStorage)
    study = optuna.create_study(storage=storage, study_name="outage")
    server.pause()
    restart = threading.Timer(3.0, server.resume)
    restart.start()
    started = time.monotonic()
    study.enqueue_trial({"x": 1})  # waits for the server to come back
    restart.join()
    assert time.monotonic() - started >= 2.5
    assert len(study.get_trials()) == 1

    server.pause()
    try:
        short = RetryingStorage(storage.inner, RetryPolicy("the test's server", budget_s=1.0))
        with pytest.raises(StorageUnavailable, match="stayed unreachable for 1 s"):
            short.get_all_studies()
    finally:
        server.resume()


def test_data_errors_are_not_retried() -> None:
    assert not is_transient(ValueError("bad data"))
    integrity = sqlalchemy.exc.IntegrityError("INSERT", {}, Exception("duplicate key"))
    assert not is_transient(integrity)
    operational = sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed"))
    wrapped = optuna.exceptions.StorageInternalError("An exception is raised during the commit")
    wrapped.__cause__ = operational
    assert is_transient(operational) and is_transient(wrapped)


def test_status_tells_an_expired_claim_from_a_live_one(tmp_path: Path) -> None:
    storage = open_storage(f"journal:{tmp_path / 'status.journal'}")
    study = optuna.create_study(storage=storage, study_name="leases")
    claims.plan_cell(study, [(f'"c{i}"', {"x": i}) for i in range(2)], spread=False)
    short = claims.Lease(seconds=0.5, renew_s=60)
    held = claims.claim_next(study, "alive:1", claims.Lease(seconds=60, renew_s=60), spread=False)
    dead = claims.claim_next(study, "dead:2", short, spread=False)
    assert held is not None and dead is not None
    time.sleep(1.0)
    status = claims.status(study, claims.Lease(seconds=60))
    assert status.running == {"alive:1": 1} and status.expired == {"dead:2": 1}
    held.finish(1.0)
    dead.finish(1.0)

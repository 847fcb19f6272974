"""Opening PostgreSQL storage: concurrent first opens, one-line errors, parallel-safety checks."""

from __future__ import annotations

import importlib.util
import multiprocessing
import socket

import optuna
import pytest
import sqlalchemy
from helpers import sqlite_url
from pg_cluster import fresh_postgres_url, postgres_url  # noqa: F401  (fixtures)

from fusionlab.errors import UserError
from fusionlab.search.storage import is_parallel_safe, open_storage


def _open_at_once(url: str, barrier, results) -> None:  # type: ignore[no-untyped-def]
    """Child: wait for the others, then open the fresh storage and create a study in it."""
    barrier.wait(timeout=60)
    try:
        storage = open_storage(url)
        optuna.create_study(storage=storage, study_name="shared", load_if_exists=True)
        results.put("ok")
    except Exception as error:  # the parent reports what any child hit
        results.put(f"{type(error).__name__}: {error}")


def test_fresh_postgres_opened_by_three_processes_at_once(fresh_postgres_url: str) -> None:  # noqa: F811
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(3), context.Queue()
    children = [
        context.Process(target=_open_at_once, args=(fresh_postgres_url, barrier, results))
        for _ in range(3)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=90) for _ in children]
    for child in children:
        child.join(timeout=30)
    assert outcomes == ["ok"] * 3, outcomes
    assert optuna.get_all_study_names(open_storage(fresh_postgres_url)) == ["shared"]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _with(url: str, **parts: str) -> str:
    return sqlalchemy.engine.make_url(url).set(**parts).render_as_string(hide_password=False)


@pytest.mark.parametrize(
    ("change", "fix"),
    [
        ({"port": "closed"}, "no server listens there"),
        ({"database": "no_such_db"}, "that database does not exist"),
        ({"username": "no_such_user"}, "that user does not exist"),
    ],
)
def test_bad_postgres_url_is_one_clear_line(postgres_url: str, change, fix) -> None:  # noqa: F811
    if change.get("port") == "closed":
        change = {"port": _closed_port()}
    url = _with(postgres_url, **change)
    with pytest.raises(UserError) as raised:
        open_storage(url)
    message = str(raised.value)
    assert "\n" not in message and fix in message, message
    assert next(iter(change.values())).__str__() in message  # names the part to fix


@pytest.mark.skipif(
    importlib.util.find_spec("psycopg2") is not None, reason="psycopg2 is installed here"
)
def test_missing_driver_says_what_to_install() -> None:
    with pytest.raises(UserError) as raised:
        open_storage(f"postgresql+psycopg2://u@127.0.0.1:{_closed_port()}/x")
    message = str(raised.value)
    assert "\n" not in message and "pip install 'fusionlab[postgres]'" in message, message


def test_sqlite_is_refused_for_parallel_workers(tmp_path) -> None:
    reason = is_parallel_safe(sqlite_url(tmp_path / "r.db"))
    assert reason is not None and "\n" not in reason
    assert "SQLite" in reason and "journal:" in reason and "postgresql" in reason
    assert is_parallel_safe(f"journal:{tmp_path / 'j.log'}") is None
    assert is_parallel_safe("postgresql+psycopg://u@127.0.0.1:5432/fusionlab") is None

"""Optuna storage chosen by URL: `sqlite:///file.db` (the default), any SQLAlchemy URL Optuna
accepts (e.g. `postgresql+psycopg://user@host/db`), or `journal:PATH` for a journal file shared by
workers.

Several processes opening a fresh PostgreSQL at once race on creating Optuna's tables (RDBStorage
runs `metadata.create_all` and an alembic stamp in its constructor, not atomically: two creators
get `UniqueViolation`), so the constructor runs under a PostgreSQL advisory lock: one creates, the
others wait and then find the tables. Unreachable servers and wrong URLs are one-line UserErrors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import BaseStorage
from sqlalchemy.pool import NullPool

from fusionlab.errors import UserError
from fusionlab.search.optuna_adapter import cached
from fusionlab.search.retry import RetryingStorage, RetryPolicy

DEFAULT_STORAGE = "sqlite:///fusionlab.db"

# Any constant shared by every fusionlab process; it names the advisory lock around table creation.
_CREATE_LOCK = 0x6675_7369_6F6E  # "fusion"
_CONNECT_TIMEOUT_S = 10


def describe(url: str) -> str:
    """One line for the user saying where results go."""
    default = " (default: an SQLite file in the working directory; change with --storage)"
    return f"storage: {url}{default if url == DEFAULT_STORAGE else ''}"


def is_parallel_safe(url: str) -> str | None:
    """Why this storage cannot serve several workers at once, or None when it can."""
    if url.startswith("sqlite:"):
        return (
            f"storage {url!r} is SQLite, which cannot serve parallel workers (Optuna discourages "
            "it: writers lock the whole file); use --storage journal:PATH or a "
            "postgresql+psycopg://USER@HOST:PORT/DB URL"
        )
    return None


def _sqlite_path(url: str) -> Path | None:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url == "sqlite:///:memory:":
        return None
    return Path(url[len(prefix) :].split("?", 1)[0])


def _journal_path(url: str) -> Path | None:
    return Path(url[len("journal:") :]) if url.startswith("journal:") else None


def _is_postgres(url: str) -> bool:
    return url.startswith(("postgresql:", "postgresql+", "postgres:"))


def _check_file(path: Path, must_exist: bool, url: str) -> None:
    if must_exist and not path.exists():
        raise UserError(f"no results at {url}: run `fusionlab sweep` first or pass --storage")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(f"storage {url!r} is unreachable: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UserError(f"storage {url!r} is unreachable: folder {str(folder)!r} is not writable")


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _postgres_error(url: str, error: BaseException) -> UserError:
    """One line naming what to fix for a PostgreSQL URL that does not open."""
    safe = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    text = str(getattr(error, "orig", None) or error)
    fixes = {
        "Connection refused": "no server listens there: start it or fix host:port",
        "failed to resolve host": "the host name does not resolve: fix the host",
        "timeout expired": "no answer from the server: check host:port and the network",
        "password authentication failed": "wrong password for that user: fix the URL",
        "role": "that user does not exist on the server: fix the user in the URL",
        "database": "that database does not exist: create it (createdb) or fix the URL",
        "no password supplied": "the server wants a password: put it in the URL",
    }
    for needle, fix in fixes.items():
        if needle in text and (needle not in ("role", "database") or "does not exist" in text):
            return UserError(f"storage {safe!r} is unreachable ({fix}): {_first_line(error)}")
    return UserError(f"storage {safe!r} is unreachable ({_first_line(error)}); check --storage")


def _missing_driver(url: str, module: str | None) -> UserError:
    if _is_postgres(url):
        hint = (
            "pip install 'fusionlab[postgres]' and use a postgresql+psycopg:// URL"
            if module != "psycopg2"
            else "use a postgresql+psycopg:// URL with pip install 'fusionlab[postgres]', "
            "or pip install psycopg2-binary"
        )
        return UserError(f"storage {url!r} needs the PostgreSQL driver {module!r}: {hint}")
    return UserError(f"storage {url!r} needs the Python package {module!r}: pip install it")


_OPTUNA_TABLES = ("studies", "trials", "version_info")


def _not_optuna(url: str, what: str) -> UserError:
    return UserError(
        f"storage {_safe_name(url)!r} is not an Optuna storage ({what}); nothing was written "
        "into it: pass the --storage your sweep wrote to"
    )


def _check_sqlite(path: Path, url: str) -> None:
    """Refuse an SQLite file without Optuna's tables, opened read-only so nothing is created."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as error:
        raise _not_optuna(url, f"not an SQLite database: {error}") from None
    missing = [table for table in _OPTUNA_TABLES if table not in names]
    if missing:
        raise _not_optuna(url, f"no {', '.join(missing)} table")


def _check_journal(path: Path, url: str) -> None:
    """Refuse a file whose first record is not an Optuna journal operation."""
    with path.open("rb") as file:
        first = file.readline(1 << 16)
    if not first:
        return  # an empty journal: no results yet, which the reader says
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise _not_optuna(url, "its first line is not an Optuna journal record")


def _open_postgres(url: str, must_exist: bool = False) -> BaseStorage:
    """RDBStorage built under an advisory lock, so concurrent first opens do not race."""
    probe = sqlalchemy.create_engine(
        url, poolclass=NullPool, connect_args={"connect_timeout": _CONNECT_TIMEOUT_S}
    )
    try:
        with probe.connect() as connection:
            if must_exist:
                present = sqlalchemy.inspect(connection).get_table_names()
                missing = [table for table in _OPTUNA_TABLES if table not in present]
                if missing:
                    raise _not_optuna(url, f"no {', '.join(missing)} table")
            lock = {"key": _CREATE_LOCK}
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), lock)
            try:
                return optuna.storages.RDBStorage(url)
            finally:
                connection.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), lock)
    finally:
        probe.dispose()


def _safe_name(url: str) -> str:
    if _is_postgres(url):
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    return url


def open_storage(url: str, must_exist: bool = False, read_only: bool = False) -> BaseStorage:
    """Open (or create) the storage behind a URL, its calls retried through storage outages
    (search/retry.py); unreachable storage is a UserError.

    `must_exist`: the storage holds results already; one that is not an Optuna storage (a
    foreign SQLite file or database, a file that is not a journal) is refused before anything
    is written into it. `read_only`: the caller only reads (a damaged journal tail is skipped
    on reading, not repaired)."""
    return RetryingStorage(_open(url, must_exist, read_only), RetryPolicy(_safe_name(url)))


def _open(url: str, must_exist: bool, read_only: bool) -> BaseStorage:
    file = _sqlite_path(url) or _journal_path(url)
    if file is not None:
        _check_file(file, must_exist, url)
    try:
        journal = _journal_path(url)
        if journal is not None:
            from optuna.storages.journal import JournalFileBackend

            if must_exist:
                _check_journal(journal, url)
            if not read_only:
                repair_journal(journal)
            return optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
        if _is_postgres(url):
            return cached(_open_postgres(url, must_exist))
        sqlite = _sqlite_path(url)
        if must_exist and sqlite is not None:
            _check_sqlite(sqlite, url)
        return cached(optuna.storages.RDBStorage(url))
    except UserError:
        raise
    except ImportError as error:
        # Optuna re-raises a missing driver as a bare ImportError; the module is on its cause.
        module = error.name or getattr(error.__cause__, "name", None)
        raise _missing_driver(url, module) from None
    except Exception as error:
        if _is_postgres(url):
            raise _postgres_error(url, error) from None
        raise UserError(
            f"storage {url!r} is unreachable ({_first_line(error)}); check --storage"
        ) from None


_TAIL_BYTES = 1 << 16


def _broken_tail(data: bytes) -> int | None:
    """Where a journal's damaged last record starts, or None when its last record is whole."""
    if not data:
        return None
    cut = data.rfind(b"\n", 0, len(data) - 1) + 1  # start of the last line
    last = data[cut:]
    if not last.endswith(b"\n"):
        return cut  # a record cut short (a crash mid-write)
    try:
        json.loads(last)
    except ValueError:
        return cut  # garbage
    return None


def repair_journal(path: Path) -> None:
    """Set a damaged last record aside (a backup of the whole file, then the record cut off)
    under the journal's own lock, so nothing is appended onto a broken line; warn once."""
    if not path.exists() or path.stat().st_size == 0:
        return
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        size = path.stat().st_size
        start = max(0, size - _TAIL_BYTES)
        with path.open("rb") as file:
            file.seek(start)
            tail = file.read()
        if start and b"\n" not in tail[:-1]:
            return  # one record longer than the window: not a tail this check can judge
        cut = _broken_tail(tail)
        if cut is None:
            return
        backup = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(path, backup)
        with path.open("r+b") as file:
            file.truncate(start + cut)
            file.flush()
            os.fsync(file.fileno())
        print(
            f"fusionlab: warning: journal {str(path)!r} ended in a damaged record "
            f"({size - start - cut} bytes, {tail[cut:cut + 40]!r}...); set it aside, the whole "
            f"file is backed up in {str(backup)!r}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        lock.release()

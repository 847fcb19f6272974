"""Optuna storage chosen by URL: `sqlite:///file.db` (the default), any SQLAlchemy URL Optuna
accepts (e.g. `postgresql://...`), or `journal:PATH` for a journal file shared by workers."""

from __future__ import annotations

import os
from pathlib import Path

import optuna
from optuna.storages import BaseStorage

from fusionlab.errors import UserError

DEFAULT_STORAGE = "sqlite:///fusionlab.db"


def describe(url: str) -> str:
    """One line for the user saying where results go."""
    default = " (default: an SQLite file in the working directory; change with --storage)"
    return f"storage: {url}{default if url == DEFAULT_STORAGE else ''}"


def _sqlite_path(url: str) -> Path | None:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url == "sqlite:///:memory:":
        return None
    return Path(url[len(prefix) :].split("?", 1)[0])


def _journal_path(url: str) -> Path | None:
    return Path(url[len("journal:") :]) if url.startswith("journal:") else None


def _check_file(path: Path, must_exist: bool, url: str) -> None:
    if must_exist and not path.exists():
        raise UserError(f"no results at {url}: run `fusionlab sweep` first or pass --storage")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(f"storage {url!r} is unreachable: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise UserError(f"storage {url!r} is unreachable: folder {str(folder)!r} is not writable")


def open_storage(url: str, must_exist: bool = False) -> BaseStorage:
    """Open (or create) the storage behind a URL; unreachable storage is a UserError."""
    file = _sqlite_path(url) or _journal_path(url)
    if file is not None:
        _check_file(file, must_exist, url)
    try:
        journal = _journal_path(url)
        if journal is not None:
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
        return optuna.storages.RDBStorage(url)
    except ModuleNotFoundError as error:
        raise UserError(
            f"storage {url!r} needs the Python package {error.name!r}: pip install it"
        ) from None
    except Exception as error:
        first_line = (
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise UserError(
            f"storage {url!r} is unreachable ({first_line[:200]}); check --storage"
        ) from None

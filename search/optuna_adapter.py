"""Every use of Optuna's private API, in one place, for the Optuna versions it was read from.

The claim protocol (search/claims.py) needs what Optuna keeps private: a study's storage and
id, a trial's id and cached record, the RDB models for targeted queries, and the cache that
`optuna.create_study` puts in front of an RDBStorage. An Optuna outside SUPPORTED fails here,
at import, with one line, instead of somewhere in the middle of a sweep.
"""

from __future__ import annotations

import time
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages._cached_storage import _CachedStorage, _StudyInfo
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial

from fusionlab.errors import UserError

# Keep in step with the optuna requirement in pyproject.toml.
SUPPORTED = ((5, 1), (5, 2))  # from (inclusive), to (exclusive), by (major, minor)


def check_version(version: str = optuna.__version__) -> None:
    """Refuse an Optuna this module was not written against."""
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    low, high = SUPPORTED
    if not low <= major_minor < high:
        raise UserError(
            f"optuna {version} is installed; fusionlab's claims are tested with optuna "
            f">={low[0]}.{low[1]},<{high[0]}.{high[1]}: pip install 'optuna>={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}'"
        )


check_version()

__all__ = ["models"]


def storage_of(study: optuna.Study) -> BaseStorage:
    return study._storage


def study_id(study: optuna.Study) -> int:
    return study._study_id


def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    return trial._trial_id


def frozen(trial: optuna.Trial) -> FrozenTrial:
    """The record a live Trial keeps of itself (no storage read)."""
    return trial._cached_frozen_trial


def forget_trials_read(study: optuna.Study) -> None:
    """What `Study.ask` does first: the sampler then reads fresh trials."""
    study._thread_local.cached_all_trials = None


def cached(storage: RDBStorage) -> BaseStorage:
    """The cache `optuna.create_study` puts in front of an RDBStorage (it adds none to a
    storage that is not an RDBStorage, such as a wrapper around this one)."""
    return _CachedStorage(storage)


def _unwrap(storage: BaseStorage) -> BaseStorage:
    inner = getattr(storage, "inner", None)  # search/retry.py's RetryingStorage
    return storage if inner is None else _unwrap(inner)


def rdb_of(storage: BaseStorage) -> RDBStorage | None:
    """The RDBStorage under a storage (wrapped for retries, cached by Optuna), if any."""
    storage = _unwrap(storage)
    if isinstance(storage, _CachedStorage):
        storage = storage._backend
    return storage if isinstance(storage, RDBStorage) else None


def adopt(study: optuna.Study, trial: int) -> None:
    """Tell a study's cache about a trial it never read: its `set_trial_param` (a suggest
    replaying the enqueued params) looks the trial up there. Study.ask() gets this from
    `_pop_waiting_trial_id` reading every WAITING trial through the cache."""
    cache = _unwrap(study._storage)
    if not isinstance(cache, _CachedStorage):
        return
    record = cache._backend.get_trial(trial)
    with cache._lock:
        info = cache._studies.setdefault(study._study_id, _StudyInfo())
        cache._add_trials_to_cache(study._study_id, [record])
        info.unfinished_trial_ids.add(trial)  # so the cache re-reads it once it ends


def server_now(storage: BaseStorage) -> float:
    """Seconds since the epoch by the storage's clock: the database server's `now()` on
    PostgreSQL (as Optuna's RDB heartbeat judges staleness), this host's clock otherwise (a
    journal file or SQLite has no clock of its own)."""
    rdb = rdb_of(storage)
    if rdb is None or rdb.engine.dialect.name != "postgresql":
        return time.time()
    with rdb.engine.connect() as connection:
        return float(connection.execute(sqlalchemy.text("SELECT extract(epoch FROM now())"))
                     .scalar_one())


def query(storage: BaseStorage, statement: Any) -> list[Any]:
    """Rows of one read-only query on the RDB under a storage."""
    rdb = rdb_of(storage)
    assert rdb is not None
    with rdb.engine.connect() as connection:
        return list(connection.execute(statement))

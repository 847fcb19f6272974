"""Storage faults survived in one place: every call that reaches a study's storage (through
`RetryingStorage`, which `open_storage` returns, or through `call` for fusionlab's own queries)
is retried with backoff while the failure is transient (connection lost, server restarting, lock
timeout) for up to FUSIONLAB_STORAGE_RETRY_S seconds (default 120). A longer outage raises
`StorageUnavailable`, a UserError: one line naming the storage and what to do, exit code 2.

Retrying is safe for the claim protocol (search/claims.py) even when a commit did land before
the connection dropped: a trial enqueued twice is resolved by the twin rule, a claim popped twice
is refused the second time (its lease then expires and it is taken over), and a result written
twice is recognised by `Claim.finish`.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy.exc
from optuna.exceptions import StorageInternalError
from optuna.storages import BaseStorage

from fusionlab.errors import UserError

RETRY_ENV = "FUSIONLAB_STORAGE_RETRY_S"
DEFAULT_RETRY_S = 120.0
_FIRST_WAIT_S = 0.2
_LONGEST_WAIT_S = 5.0

T = TypeVar("T")


class StorageUnavailable(UserError):
    """The storage stayed unreachable for the whole retry budget."""


def retry_budget_s() -> float:
    """How long a storage call keeps retrying a transient failure (FUSIONLAB_STORAGE_RETRY_S)."""
    text = os.environ.get(RETRY_ENV)
    if text is None:
        return DEFAULT_RETRY_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UserError(f"{RETRY_ENV}={text!r} must be a number of seconds, 0 or more")
    return value


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.TimeoutError,  # no pooled connection came back in time
        ConnectionError,
        TimeoutError,
    ]
    try:
        import psycopg

        types.append(psycopg.OperationalError)
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT = _transient_types()


def is_transient(error: BaseException) -> bool:
    """Whether a storage error may go away by itself: the storage, not the data, failed.

    Optuna wraps a failed commit in StorageInternalError ("...invalid data in the commit...")
    whatever the cause; the cause, or the error a failed rollback chained to it, tells."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _TRANSIENT):
            return True
        if isinstance(current, sqlalchemy.exc.DBAPIError) and current.connection_invalidated:
            return True
        current = current.__cause__ or current.__context__
    return False


def _first_line(error: BaseException) -> str:
    cause = error
    while isinstance(cause, StorageInternalError) and cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(getattr(cause, "orig", None) or cause).strip()
    return text.splitlines()[0][:160] if text else type(cause).__name__


class RetryPolicy:
    """Retries transient failures of one storage; says once per outage that it is waiting."""

    def __init__(self, name: str, budget_s: float | None = None) -> None:
        self.name = name
        self.budget_s = retry_budget_s() if budget_s is None else budget_s
        self._lock = threading.Lock()
        self._outage = False

    def call(self, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.budget_s
        wait = _FIRST_WAIT_S
        while True:
            try:
                result = fn()
            except Exception as error:
                if not is_transient(error):
                    raise
                if time.monotonic() + wait > deadline:
                    raise StorageUnavailable(
                        f"storage {self.name!r} stayed unreachable for {self.budget_s:g} s "
                        f"({_first_line(error)}): bring it back and run the same command again "
                        f"to resume (what was stored is kept; {RETRY_ENV} sets the wait)"
                    ) from None
                self._say_waiting(error)
                time.sleep(wait * random.uniform(0.8, 1.2))
                wait = min(wait * 2, _LONGEST_WAIT_S)
                continue
            self._say_back()
            return result

    def _say_waiting(self, error: BaseException) -> None:
        with self._lock:
            if self._outage:
                return
            self._outage = True
        print(
            f"fusionlab: storage {self.name!r} unreachable ({_first_line(error)}); retrying for "
            f"up to {self.budget_s:g} s",
            file=sys.stderr,
            flush=True,
        )

    def _say_back(self) -> None:
        if not self._outage:
            return
        with self._lock:
            if not self._outage:
                return
            self._outage = False
        print(f"fusionlab: storage {self.name!r} is back", file=sys.stderr, flush=True)


class RetryingStorage(BaseStorage):
    """An Optuna storage whose every public call is retried by a RetryPolicy."""

    def __init__(self, inner: BaseStorage, policy: RetryPolicy) -> None:
        self.inner = inner
        self.policy = policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _retried(name: str) -> Callable[..., Any]:
    def method(self: RetryingStorage, *args: Any, **kwargs: Any) -> Any:
        return self.policy.call(lambda: getattr(self.inner, name)(*args, **kwargs))

    method.__name__ = name
    method.__doc__ = f"`{name}` of the wrapped storage, retried while the storage is away."
    return method


for _name, _member in vars(BaseStorage).items():
    if callable(_member) and not _name.startswith("_"):
        setattr(RetryingStorage, _name, _retried(_name))
RetryingStorage.__abstractmethods__ = frozenset()

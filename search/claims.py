"""Claims: many workers share one cell's study and each configuration is measured exactly once.

Protocol (PostgreSQL through Optuna's RDBStorage, or a journal file through JournalStorage):

* Planning enqueues every configuration with no live trial as a WAITING trial whose `config` user
  attr is the configuration's JSON key (`Study.enqueue_trial(params, user_attrs=...)` writes both in
  one trial creation). Planners racing may enqueue a configuration twice; claims resolve that.
* A claim pops one WAITING trial with Optuna's own atomic WAITING->RUNNING transition
  (`storage.set_trial_state_values(id, RUNNING)`, as `Study._pop_waiting_trial_id` does: RDB does
  `SELECT ... FOR UPDATE` and refuses unless the row is WAITING; the journal's replay keeps only
  the first RUNNING log and returns True only to its issuer). The RUNNING trial is the claim,
  tagged with `worker` (host:pid) and a `lease_until` that a background thread renews.
* Twins: the lowest-numbered live (WAITING, RUNNING, COMPLETE, FAIL) trial of a configuration
  measures it; a claimant that is not the lowest tells its trial PRUNED (`duplicate_of`). This is
  sound because RDB numbers trials under a `FOR UPDATE` lock on the study row held until commit
  (`RDBStorage._create_new_trial`) and the journal numbers them in log order, so a lower-numbered
  twin is always visible to whoever popped a higher one. FAIL means "measured, failed": only
  `Claim.finish(None)` writes it; every trial that measured nothing ends PRUNED.
* Leases, not Optuna's heartbeat: JournalStorage has no heartbeat in Optuna 5.1, and RDBStorage's
  `_get_stale_trial_ids` skips trials that never recorded one (a worker killed between the pop and
  its first beat would hold its claim forever). A RUNNING trial whose `lease_until` (or, before the
  first renewal, `datetime_start` + lease) has passed is taken over: whoever wins the atomic
  RUNNING->PRUNED transition (RDB: row lock, the loser gets UpdateFinishedTrialError; journal: the
  log orders them, the loser's replay raises it) re-enqueues the configuration (`retry_of`), like
  `optuna.storages.RetryFailedTrialCallback` but exactly once. Clocks of the hosts must agree
  (NTP) to well under the lease. A taken-over worker that is in fact alive loses its `finish`.
* TPE cells: `propose` samples on a fresh trial (not `study.ask()`, which would pop a WAITING
  configuration; use `TPESampler(constant_liar=True)`, Optuna 5.1's default, so RUNNING claims
  steer other workers away), turns the suggestion into an enqueued
  configuration unless it is live already, and ends the proposal trial without a `config` attr:
  FAIL (TPE ignores it), or, for a configuration measured already, COMPLETE with its value so
  that TPE sees the point again and moves on. The twin rule above then dedupes concurrent proposals.

Sources: optuna 5.1 `optuna/study/study.py` (`ask`, `_pop_waiting_trial_id`, `enqueue_trial`),
`optuna/storages/_rdb/storage.py`, `optuna/storages/journal/_storage.py`,
`optuna/storages/_heartbeat.py`, `optuna/storages/_callbacks.py`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import optuna
import sqlalchemy
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages._cached_storage import _CachedStorage, _StudyInfo
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial, TrialState

CONFIG = "config"
WORKER = "worker"
LEASE = "lease_until"
LIVE = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)
_PLAN_CHUNK = 16  # configurations enqueued between re-reads, so concurrent planners see each other

Configs = Sequence[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Lease:
    """How long a claim survives without renewal, and how often its holder renews it."""

    seconds: float = 120.0
    renew_s: float = 15.0


def worker_name() -> str:
    """This process as a claim holder: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _sql(storage: BaseStorage) -> RDBStorage | None:
    """The RDBStorage under a study's storage (Study wraps it in a _CachedStorage), if any."""
    if isinstance(storage, _CachedStorage):
        storage = storage._backend
    return storage if isinstance(storage, RDBStorage) else None


def _key_of(trial: FrozenTrial) -> str | None:
    return trial.user_attrs.get(CONFIG)


def _keys_in(study: optuna.Study, states: Sequence[TrialState]) -> set[str]:
    """Keys of every configuration that has a trial in one of these states."""
    rdb = _sql(study._storage)
    if rdb is None:
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False, states=states)
        return {key for t in trials if (key := _key_of(t)) is not None}
    # A targeted query: get_all_trials would load every trial's records (KBs each) to read keys.
    query = (
        sqlalchemy.select(models.TrialUserAttributeModel.value_json)
        .join(models.TrialModel)
        .where(models.TrialModel.study_id == study._study_id)
        .where(models.TrialModel.state.in_(states))
        .where(models.TrialUserAttributeModel.key == CONFIG)
    )
    with rdb.engine.connect() as connection:
        return {json.loads(value) for (value,) in connection.execute(query)}


def _live_keys(study: optuna.Study) -> set[str]:
    """Keys of every configuration that has a live trial."""
    return _keys_in(study, LIVE)


def done_keys(study: optuna.Study) -> set[str]:
    """Keys of every configuration measured (passed or failed)."""
    return _keys_in(study, (TrialState.COMPLETE, TrialState.FAIL))


def _twins(study: optuna.Study, key: str) -> list[tuple[int, TrialState]]:
    """(number, state) of every trial of one configuration."""
    rdb = _sql(study._storage)
    if rdb is None:
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False)
        return [(t.number, t.state) for t in trials if _key_of(t) == key]
    query = (
        sqlalchemy.select(models.TrialModel.number, models.TrialModel.state)
        .join(models.TrialUserAttributeModel)
        .where(models.TrialModel.study_id == study._study_id)
        .where(models.TrialUserAttributeModel.key == CONFIG)
        .where(models.TrialUserAttributeModel.value_json == json.dumps(key))
    )
    with rdb.engine.connect() as connection:
        return [(number, state) for number, state in connection.execute(query)]


def _waiting(study: optuna.Study) -> list[tuple[int, str | None]]:
    """(trial id, config key) of every WAITING trial, oldest first."""
    rdb = _sql(study._storage)
    if rdb is None:
        trials = study._storage.get_all_trials(
            study._study_id, deepcopy=False, states=(TrialState.WAITING,)
        )
        return [(t._trial_id, _key_of(t)) for t in trials]
    query = (
        sqlalchemy.select(models.TrialModel.trial_id, models.TrialUserAttributeModel.value_json)
        .join(models.TrialUserAttributeModel, isouter=True)
        .where(models.TrialModel.study_id == study._study_id)
        .where(models.TrialModel.state == TrialState.WAITING)
        .where(
            sqlalchemy.or_(
                models.TrialUserAttributeModel.key == CONFIG,
                models.TrialUserAttributeModel.key.is_(None),
            )
        )
        .order_by(models.TrialModel.number)
    )
    with rdb.engine.connect() as connection:
        return [
            (trial_id, None if value is None else json.loads(value))
            for trial_id, value in connection.execute(query)
        ]


def _enqueue(study: optuna.Study, key: str, params: dict[str, Any], **attrs: Any) -> None:
    study.enqueue_trial(params, user_attrs={CONFIG: key, **attrs})


def plan_cell(study: optuna.Study, configs: Configs, spread: bool = True) -> int:
    """Enqueue every configuration that has no live trial; returns how many were enqueued.

    With `spread` each planner starts at a random offset and re-reads between chunks, so
    planners started together mostly enqueue different configurations; the twins left are
    resolved at claim time. Without it the configurations are enqueued in the given order.
    """
    if not configs:
        return 0
    start = random.randrange(len(configs)) if spread else 0
    order = [*configs[start:], *configs[:start]]
    enqueued = 0
    for begin in range(0, len(order), _PLAN_CHUNK):
        live = _live_keys(study)
        for key, params in order[begin : begin + _PLAN_CHUNK]:
            if key not in live:
                _enqueue(study, key, params)
                enqueued += 1
    return enqueued


class Claim:
    """One configuration this worker holds and must measure; renews its lease until it ends."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial, worker: str, lease: Lease) -> None:
        self.study = study
        self.trial = trial
        self.key: str = self.trial._cached_frozen_trial.user_attrs[CONFIG]
        self.worker = worker
        self.lost = False  # taken over by another worker (this one looked dead)
        self._lease = lease
        self._stop = threading.Event()
        self._renew()
        self.trial.set_user_attr(WORKER, worker)
        self._thread = threading.Thread(target=self._keep_alive, daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        self.trial.set_user_attr(LEASE, time.time() + self._lease.seconds)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self._lease.renew_s):
            try:
                self._renew()
            except UpdateFinishedTrialError:
                self.lost = True
                return

    def _end(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def finish(self, value: float | None, user_attrs: dict[str, Any] | None = None) -> bool:
        """Store the measurement (None: it failed) and end the claim; False if it was lost."""
        self._end()
        state = TrialState.FAIL if value is None else TrialState.COMPLETE
        values = None if value is None else [value]
        try:
            for name, attr in (user_attrs or {}).items():
                self.trial.set_user_attr(name, attr)
            # What study.tell does, less its two re-reads of the trial (a third of a claim's
            # cost); the sampler hook sees the trial as claimed, which its users never read.
            self.study.sampler.after_trial(
                self.study, self.trial._cached_frozen_trial, state, values
            )
            self.study._storage.set_trial_state_values(self.trial._trial_id, state, values)
        except UpdateFinishedTrialError:
            self.lost = True
        return not self.lost

    def release(self) -> None:
        """Give the configuration back unmeasured (Ctrl-C, shutdown): another worker takes it."""
        self._end()
        if _take_back(self.study, self.trial._cached_frozen_trial, "released"):
            return
        self.lost = True

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        """An exception before `finish` (Ctrl-C included) releases the configuration."""
        if self._thread.is_alive():
            self.release()


def _take_back(study: optuna.Study, trial: FrozenTrial, why: str) -> bool:
    """End a RUNNING trial PRUNED and re-enqueue its configuration; True if this call won."""
    try:
        study._storage.set_trial_state_values(trial._trial_id, TrialState.PRUNED)
    except UpdateFinishedTrialError:
        # RDB: the row lock made us second; journal: our log replayed after another end.
        return False
    params = trial.system_attrs["fixed_params"]
    _enqueue(study, trial.user_attrs[CONFIG], params, retry_of=trial.number, retry_why=why)
    return True


def _expired(trial: FrozenTrial, lease: Lease, now: float) -> bool:
    until = trial.user_attrs.get(LEASE)
    if until is None:  # killed between the pop and its first lease write
        assert trial.datetime_start is not None
        return (datetime.now() - trial.datetime_start).total_seconds() > lease.seconds
    return now > until


def take_over_stale(study: optuna.Study, lease: Lease) -> int:
    """Re-enqueue the configuration of every claim whose lease ran out; returns how many."""
    running = study._storage.get_all_trials(
        study._study_id, deepcopy=False, states=(TrialState.RUNNING,)
    )
    now = time.time()
    return sum(
        _take_back(study, trial, "lease expired")
        for trial in running
        if CONFIG in trial.user_attrs and _expired(trial, lease, now)
    )


def claim_next(
    study: optuna.Study,
    worker: str | None = None,
    lease: Lease = Lease(),
    accept: Callable[[str], bool] | None = None,
    spread: bool = True,
) -> Claim | None:
    """Claim a configuration this worker alone will measure; None when nothing waits now.

    `accept` limits the claim to configurations this worker can measure (a worker whose plan
    names fewer variants leaves the others' configurations waiting for someone else).
    `spread` starts at a random waiting trial, so workers that start together mostly claim
    different ones; without it the claim follows the plan's order."""
    worker = worker or worker_name()
    while True:
        waiting = [
            trial_id
            for trial_id, key in _waiting(study)
            if accept is None or (key is not None and accept(key))
        ]
        if not waiting:
            # Nothing waits: take over dead workers' claims, then look again.
            if take_over_stale(study, lease):
                continue
            return None
        # Workers that start together would all try the first WAITING trial; a random start
        # spreads them so most first tries win. A lost try means another worker progressed.
        start = random.randrange(len(waiting)) if spread else 0
        for trial_id in waiting[start:] + waiting[:start]:
            try:
                if not study._storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                    continue
            except UpdateFinishedTrialError:
                continue
            try:
                claim = _resolve_twins(study, trial_id, worker, lease)
            except BaseException:  # Ctrl-C between the pop and the claim: give the trial back
                _take_back(study, study._storage.get_trial(trial_id), "released")
                raise
            if claim is not None:
                return claim


def _adopt(study: optuna.Study, trial_id: int) -> None:
    """Tell the Study's _CachedStorage about a trial it never read: its `set_trial_param` (a
    suggest replaying the enqueued params) looks the trial up there. Study.ask() gets this from
    `_pop_waiting_trial_id` reading every WAITING trial through the cache, which is what this
    module avoids."""
    storage = study._storage
    if not isinstance(storage, _CachedStorage):
        return
    frozen = storage._backend.get_trial(trial_id)
    with storage._lock:
        info = storage._studies.setdefault(study._study_id, _StudyInfo())
        storage._add_trials_to_cache(study._study_id, [frozen])
        info.unfinished_trial_ids.add(trial_id)  # so the cache re-reads it once it ends


def _resolve_twins(study: optuna.Study, trial_id: int, worker: str, lease: Lease) -> Claim | None:
    _adopt(study, trial_id)
    trial = optuna.Trial(study, trial_id)
    key = _key_of(trial._cached_frozen_trial)
    assert key is not None, f"trial {trial.number} was enqueued without a {CONFIG!r} attr"
    lowest = min(number for number, state in _twins(study, key) if state in LIVE)
    if lowest == trial.number:
        return Claim(study, trial, worker, lease)
    study._storage.set_trial_user_attr(trial_id, "duplicate_of", lowest)
    study._storage.set_trial_state_values(trial_id, TrialState.PRUNED)
    return None


def propose(
    study: optuna.Study,
    suggest: Callable[[optuna.Trial], tuple[str, dict[str, Any]] | None],
) -> str | None:
    """One TPE proposal, enqueued as a configuration unless it is live already.

    `suggest` draws on the trial (define-by-run) and returns (key, Optuna params), or None when
    the suggestion cannot run (it records why on the trial, which ends PRUNED so TPE learns to
    avoid it). Returns the key when it was enqueued, None otherwise; claim it with `claim_next`.
    """
    # Not study.ask(): it would pop a WAITING configuration (someone's claim) as the proposal.
    study._thread_local.cached_all_trials = None  # as ask() does: the sampler reads fresh trials
    trial = optuna.Trial(study, study._storage.create_new_trial(study._study_id))
    proposal = suggest(trial)
    if proposal is None:
        study.tell(trial, state=TrialState.PRUNED)
        return None
    key, params = proposal
    fresh = key not in _live_keys(study)
    if fresh:
        _enqueue(study, key, params)
    trial.set_user_attr("proposal", key)
    # A proposal of a configuration measured already ends with its value, so TPE sees the point
    # again and moves on; every other proposal ends FAIL, which TPE ignores.
    value = None if fresh else _value_of(study, key)
    if value is None:
        study.tell(trial, state=TrialState.FAIL)
    else:
        study.tell(trial, value)
    return key if fresh else None


def _value_of(study: optuna.Study, key: str) -> float | None:
    """The stored value of a configuration measured with success, if any."""
    done = study._storage.get_all_trials(
        study._study_id, deepcopy=False, states=(TrialState.COMPLETE,)
    )
    return next((t.value for t in done if _key_of(t) == key), None)


@dataclass
class Status:
    """Where a cell stands: configurations done, claims running (by worker), trials waiting."""

    done: int = 0
    waiting: int = 0
    running: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    retried: int = 0


def status(study: optuna.Study) -> Status:
    """Counts over the cell's trials (reads every trial: for progress lines, not hot loops)."""
    trials = [t for t in study.get_trials(deepcopy=False) if CONFIG in t.user_attrs]
    return Status(
        done=len({_key_of(t) for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)}),
        waiting=sum(t.state == TrialState.WAITING for t in trials),
        running=dict(
            Counter(t.user_attrs.get(WORKER, "?") for t in trials if t.state == TrialState.RUNNING)
        ),
        duplicates=sum("duplicate_of" in t.user_attrs for t in trials),
        retried=sum("retry_of" in t.user_attrs for t in trials),
    )


def anything_running(study: optuna.Study) -> bool:
    """Whether any worker holds a claim in this cell now."""
    return bool(
        study._storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.RUNNING,))
    )

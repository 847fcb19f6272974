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
  `Claim.finish(None)` writes it; every trial that measured nothing ends PRUNED, a cell's
  re-measurement included (`Claim.close`: its result is the cell's verdict attribute).
* Leases, not Optuna's heartbeat: JournalStorage has no heartbeat in Optuna 5.1, and RDBStorage's
  `_get_stale_trial_ids` skips trials that never recorded one (a worker killed between the pop and
  its first beat would hold its claim forever). A RUNNING trial whose `lease_until` (or, before the
  first renewal, `datetime_start` + lease) has passed is taken over: whoever wins the atomic
  RUNNING->PRUNED transition (RDB: row lock, the loser gets UpdateFinishedTrialError; journal: the
  log orders them, the loser's replay raises it) re-enqueues the configuration (`retry_of`), like
  `optuna.storages.RetryFailedTrialCallback` but exactly once. Clocks of the hosts must agree
  A lease is judged by one clock: the database server's `now()` on PostgreSQL (as Optuna's
  RDB heartbeat does), the hosts' clocks on a journal file (they must agree, NTP, to well under
  the lease). A taken-over worker that is in fact alive loses its `finish`.
* Storage outages: every storage call here is retried through search/retry.py, and the lease
  renewal thread keeps renewing through an outage shorter than the retry budget.
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import optuna
import sqlalchemy
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from fusionlab.search import optuna_adapter as adapter
from fusionlab.search.optuna_adapter import frozen, models, storage_of, study_id
from fusionlab.search.optuna_adapter import trial_id as trial_id_of
from fusionlab.search.retry import StorageUnavailable

T = TypeVar("T")

CONFIG = "config"
WORKER = "worker"
LEASE = "lease_until"
CLOSED = "closed"  # why a claim that measured no configuration ended (PRUNED)
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


def _retried(study: optuna.Study, fn: Callable[[], T]) -> T:
    """A call that reaches the storage without going through it (fusionlab's own queries),
    retried by the storage's policy when it has one (open_storage gives it one)."""
    policy = getattr(storage_of(study), "policy", None)
    return fn() if policy is None else policy.call(fn)


def _query(study: optuna.Study, statement: Any) -> list[Any]:
    return _retried(study, lambda: adapter.query(storage_of(study), statement))


def storage_now(study: optuna.Study) -> float:
    """Now, by the clock leases are judged by (see the module docstring)."""
    return _retried(study, lambda: adapter.server_now(storage_of(study)))


def _key_of(trial: FrozenTrial) -> str | None:
    return trial.user_attrs.get(CONFIG)


def _keys_in(study: optuna.Study, states: Sequence[TrialState]) -> set[str]:
    """Keys of every configuration that has a trial in one of these states."""
    rdb = adapter.rdb_of(storage_of(study))
    if rdb is None:
        trials = storage_of(study).get_all_trials(study_id(study), deepcopy=False, states=states)
        return {key for t in trials if (key := _key_of(t)) is not None}
    # A targeted query: get_all_trials would load every trial's records (KBs each) to read keys.
    query = (
        sqlalchemy.select(models.TrialUserAttributeModel.value_json)
        .join(models.TrialModel)
        .where(models.TrialModel.study_id == study_id(study))
        .where(models.TrialModel.state.in_(states))
        .where(models.TrialUserAttributeModel.key == CONFIG)
    )
    return {json.loads(value) for (value,) in _query(study, query)}


def _live_keys(study: optuna.Study) -> set[str]:
    """Keys of every configuration that has a live trial."""
    return _keys_in(study, LIVE)


def done_keys(study: optuna.Study) -> set[str]:
    """Keys of every configuration measured (passed or failed)."""
    return _keys_in(study, (TrialState.COMPLETE, TrialState.FAIL))


def _twins(study: optuna.Study, key: str) -> list[tuple[int, TrialState]]:
    """(number, state) of every trial of one configuration."""
    rdb = adapter.rdb_of(storage_of(study))
    if rdb is None:
        trials = storage_of(study).get_all_trials(study_id(study), deepcopy=False)
        return [(t.number, t.state) for t in trials if _key_of(t) == key]
    query = (
        sqlalchemy.select(models.TrialModel.number, models.TrialModel.state)
        .join(models.TrialUserAttributeModel)
        .where(models.TrialModel.study_id == study_id(study))
        .where(models.TrialUserAttributeModel.key == CONFIG)
        .where(models.TrialUserAttributeModel.value_json == json.dumps(key))
    )
    return [(number, state) for number, state in _query(study, query)]


def _waiting(study: optuna.Study) -> list[tuple[int, str | None]]:
    """(trial id, config key) of every WAITING trial, oldest first."""
    rdb = adapter.rdb_of(storage_of(study))
    if rdb is None:
        trials = storage_of(study).get_all_trials(
            study_id(study), deepcopy=False, states=(TrialState.WAITING,)
        )
        return [(trial_id_of(t), _key_of(t)) for t in trials]
    query = (
        sqlalchemy.select(models.TrialModel.trial_id, models.TrialUserAttributeModel.value_json)
        .join(models.TrialUserAttributeModel, isouter=True)
        .where(models.TrialModel.study_id == study_id(study))
        .where(models.TrialModel.state == TrialState.WAITING)
        .where(
            sqlalchemy.or_(
                models.TrialUserAttributeModel.key == CONFIG,
                models.TrialUserAttributeModel.key.is_(None),
            )
        )
        .order_by(models.TrialModel.number)
    )
    rows = _query(study, query)
    return [(tid, None if value is None else json.loads(value)) for tid, value in rows]


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
        self.key: str = frozen(self.trial).user_attrs[CONFIG]
        self.worker = worker
        self.lost = False  # taken over by another worker (this one looked dead)
        self.unreachable: StorageUnavailable | None = None  # the renewal gave up on the storage
        self._lease = lease
        self._stop = threading.Event()
        self._renew()
        self.trial.set_user_attr(WORKER, worker)
        self._thread = threading.Thread(target=self._keep_alive, daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        self.trial.set_user_attr(LEASE, storage_now(self.study) + self._lease.seconds)

    def _keep_alive(self) -> None:
        """Renew until the claim ends; through an outage the renewal waits in the retry."""
        while not self._stop.wait(self._lease.renew_s):
            try:
                self._renew()
            except UpdateFinishedTrialError:
                self.lost = True
                return
            except StorageUnavailable as error:
                self.unreachable = error
                return

    def _end(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def finish(self, value: float | None, user_attrs: dict[str, Any] | None = None) -> bool:
        """Store the measurement (None: it failed) and end the claim; False if it was lost."""
        state = TrialState.FAIL if value is None else TrialState.COMPLETE
        return self._end_as(state, None if value is None else [value], user_attrs or {})

    def close(self, why: str) -> bool:
        """End a claim that measured no configuration PRUNED, with why: a cell's re-measurement
        (its result is the cell's verdict) or one with nothing left to do. Bookkeeping is never
        a failed trial of the search (optuna-dashboard shows FAIL as a failure)."""
        return self._end_as(TrialState.PRUNED, None, {CLOSED: why})

    def _end_as(
        self, state: TrialState, values: list[float] | None, user_attrs: dict[str, Any]
    ) -> bool:
        self._end()
        try:
            for name, attr in user_attrs.items():
                self.trial.set_user_attr(name, attr)
            # What study.tell does, less its two re-reads of the trial (a third of a claim's
            # cost); the sampler hook sees the trial as claimed, which its users never read.
            self.study.sampler.after_trial(self.study, frozen(self.trial), state, values)
            storage_of(self.study).set_trial_state_values(trial_id_of(self.trial), state, values)
        except UpdateFinishedTrialError:
            # Only a claim's holder ends it COMPLETE or FAIL, or PRUNED with CLOSED (a taker-over
            # ends it PRUNED without): a trial already so is our own write, landed before the
            # connection broke.
            stored = storage_of(self.study).get_trial(trial_id_of(self.trial))
            ours = state is not TrialState.PRUNED or CLOSED in stored.user_attrs
            self.lost = stored.state != state or not ours
        except StorageUnavailable as error:
            measured = state is not TrialState.PRUNED and (values is not None or user_attrs)
            what = "measurement" if measured else "result"
            raise StorageUnavailable(
                f"{error} (this worker's {what} of {self.key} could not be stored: the "
                "configuration will be measured again on resume)"
            ) from None
        return not self.lost

    def release(self) -> None:
        """Give the configuration back unmeasured (Ctrl-C, shutdown): another worker takes it."""
        self._end()
        if _take_back(self.study, frozen(self.trial), "released"):
            return
        self.lost = True

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        """An exception before `finish` (Ctrl-C included) releases the configuration; when
        the storage is gone the claim is left to expire."""
        if kind is not None and issubclass(kind, StorageUnavailable):
            self._stop.set()
        elif self._thread.is_alive():
            self.release()


def _take_back(study: optuna.Study, trial: FrozenTrial, why: str) -> bool:
    """End a RUNNING trial PRUNED and re-enqueue its configuration; True if this call won."""
    try:
        storage_of(study).set_trial_state_values(trial_id_of(trial), TrialState.PRUNED)
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
    running = storage_of(study).get_all_trials(
        study_id(study), deepcopy=False, states=(TrialState.RUNNING,)
    )
    now = storage_now(study)
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
                if not storage_of(study).set_trial_state_values(trial_id, TrialState.RUNNING):
                    continue
            except UpdateFinishedTrialError:
                continue
            try:
                claim = _resolve_twins(study, trial_id, worker, lease)
            except StorageUnavailable:
                raise  # the claim's lease expires and another worker takes it over
            except BaseException:  # Ctrl-C between the pop and the claim: give the trial back
                _take_back(study, storage_of(study).get_trial(trial_id), "released")
                raise
            if claim is not None:
                return claim


def _resolve_twins(study: optuna.Study, trial_id: int, worker: str, lease: Lease) -> Claim | None:
    _retried(study, lambda: adapter.adopt(study, trial_id))
    trial = optuna.Trial(study, trial_id)
    key = _key_of(frozen(trial))
    assert key is not None, f"trial {trial.number} was enqueued without a {CONFIG!r} attr"
    lowest = min(number for number, state in _twins(study, key) if state in LIVE)
    if lowest == trial.number:
        return Claim(study, trial, worker, lease)
    storage_of(study).set_trial_user_attr(trial_id, "duplicate_of", lowest)
    storage_of(study).set_trial_state_values(trial_id, TrialState.PRUNED)
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
    adapter.forget_trials_read(study)
    trial = optuna.Trial(study, storage_of(study).create_new_trial(study_id(study)))
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
    done = storage_of(study).get_all_trials(
        study_id(study), deepcopy=False, states=(TrialState.COMPLETE,)
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
    expired: dict[str, int] = field(default_factory=dict)  # claims whose lease ran out


def status(study: optuna.Study, lease: Lease = Lease()) -> Status:
    """Counts over the cell's trials (reads every trial: for progress lines, not hot loops).
    A RUNNING claim whose lease ran out (its worker died or lost the storage) counts as expired,
    not running: the next worker to look takes it over."""
    trials = [t for t in study.get_trials(deepcopy=False) if CONFIG in t.user_attrs]
    now = storage_now(study)
    claimed = [t for t in trials if t.state == TrialState.RUNNING]
    return Status(
        done=len({_key_of(t) for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)}),
        waiting=sum(t.state == TrialState.WAITING for t in trials),
        running=dict(
            Counter(t.user_attrs.get(WORKER, "?") for t in claimed if not _expired(t, lease, now))
        ),
        duplicates=sum("duplicate_of" in t.user_attrs for t in trials),
        retried=sum("retry_of" in t.user_attrs for t in trials),
        expired=dict(
            Counter(t.user_attrs.get(WORKER, "?") for t in claimed if _expired(t, lease, now))
        ),
    )


def has_work(study: optuna.Study) -> bool:
    """Whether a cell has a configuration waiting or a claim held: something to join."""
    return bool(_waiting(study)) or anything_running(study)


def anything_running(study: optuna.Study) -> bool:
    """Whether any worker holds a claim in this cell now (a proposal trial, RUNNING for a
    moment, is not a claim)."""
    running = storage_of(study).get_all_trials(
        study_id(study), deepcopy=False, states=(TrialState.RUNNING,)
    )
    return any(CONFIG in t.user_attrs for t in running)

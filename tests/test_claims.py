"""The claim protocol with real worker processes on real PostgreSQL and real journal files: every
configuration measured exactly once, twins resolved, dead workers' claims taken over."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from pg_cluster import postgres_url  # noqa: F401  (fixture)

from fusionlab.search import claims
from fusionlab.search.retry import StorageUnavailable
from fusionlab.search.storage import open_storage

# 32 renewal periods per lease: a holder whose renewals a loaded 2-core machine delays by seconds
# keeps its claim (a 2 s lease was taken over from live holders under load, and their next
# renewal then failed on the finished trial).
LEASE = claims.Lease(seconds=8.0, renew_s=0.25)
SPAWN = multiprocessing.get_context("spawn")


def _configs(n: int) -> list[tuple[str, dict[str, Any]]]:
    return [(f'{{"x": {x}}}', {"x": x}) for x in range(n)]


def _study(url: str, name: str, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    return optuna.create_study(
        storage=open_storage(url),
        study_name=name,
        load_if_exists=True,
        sampler=sampler or optuna.samplers.RandomSampler(seed=1),
    )


def _work_cell(
    study: optuna.Study,
    configs: list[tuple[str, dict[str, Any]]],
    measure: Callable[[claims.Claim], tuple[float | None, dict[str, Any]]],
    lease: claims.Lease,
) -> list[str]:
    """The protocol's worker loop, as search/runner.py runs it: plan, claim and measure until
    every configuration is done by someone, waiting while others hold the last claims (a holder
    may die and leave its claim to this worker). Returns the keys this worker measured."""
    worker = claims.worker_name()
    claims.plan_cell(study, configs)
    measured: list[str] = []
    while True:
        claim = claims.claim_next(study, worker, lease)
        if claim is None:
            if claims.anything_running(study):
                time.sleep(lease.renew_s)
                continue
            if claims.plan_cell(study, configs):  # a taker-over died before re-enqueueing
                continue
            return measured
        with claim:
            value, attrs = measure(claim)
            if claim.finish(value, attrs):
                measured.append(claim.key)


def _worker(url: str, name: str, n: int, barrier: Any, hung: Any = None) -> None:
    """Child: plan the cell and measure configurations (a few ms each, recording its pid).

    With `hung`, the first claim is never finished: its key goes on the queue and the child
    sleeps until the parent SIGKILLs it.
    """
    if barrier is not None:
        barrier.wait(timeout=60)
    study = _study(url, name)
    first = [True]

    def measure(claim: claims.Claim) -> tuple[float | None, dict[str, Any]]:
        x = claim.trial.suggest_int("x", 0, n - 1)  # replays the enqueued value
        if hung is not None:
            hung.put(claim.key)
            time.sleep(600)
        if barrier is not None and first[0]:
            # Hold the first claim until another worker holds one too, so the cell is shared
            # however late the scheduler of a loaded machine starts the others.
            first[0] = False
            deadline = time.monotonic() + 60
            while len(claims.status(study).running) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(0.005)
        return float(x), {"pid": os.getpid()}

    _work_cell(study, _configs(n), measure, LEASE)


@pytest.fixture(params=["postgres", "journal"])
def url(request, tmp_path) -> str:
    if request.param == "journal":
        return f"journal:{tmp_path / 'claims.log'}"
    return request.getfixturevalue("postgres_url")


def _completed_once(study: optuna.Study, n: int) -> list[optuna.trial.FrozenTrial]:
    """Asserts every configuration is stored exactly once, measured as itself; returns those."""
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.user_attrs["config"] for t in done) == sorted(k for k, _ in _configs(n))
    assert all(t.value == t.params["x"] for t in done)
    assert all(t.user_attrs["worker"].endswith(f":{t.user_attrs['pid']}") for t in done)
    assert not [t for t in trials if t.state in (TrialState.FAIL, TrialState.RUNNING)]
    assert not [t for t in trials if t.state == TrialState.WAITING]
    return done


def test_four_workers_planning_one_cell_together_measure_each_config_once(url: str) -> None:
    name, n = f"cell-{uuid.uuid4().hex[:8]}", 40
    barrier = SPAWN.Barrier(4)
    workers = [SPAWN.Process(target=_worker, args=(url, name, n, barrier)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0] * 4
    done = _completed_once(_study(url, name), n)
    assert len({t.user_attrs["pid"] for t in done}) >= 2  # the cell really was shared


def test_sigkilled_worker_claim_is_taken_over_and_finished_once(url: str) -> None:
    name, n = f"cell-{uuid.uuid4().hex[:8]}", 12
    hung = SPAWN.Queue()
    doomed = SPAWN.Process(target=_worker, args=(url, name, n, None, hung))
    doomed.start()
    key = hung.get(timeout=90)  # the doomed worker is mid-measurement of `key`
    others = [SPAWN.Process(target=_worker, args=(url, name, n, None)) for _ in range(2)]
    for worker in others:
        worker.start()
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(timeout=30)
    for worker in others:
        worker.join(timeout=120)
    assert [w.exitcode for w in others] == [0, 0]
    study = _study(url, name)
    done = _completed_once(study, n)
    assert doomed.pid not in {t.user_attrs["pid"] for t in done}
    by_doomed = f":{doomed.pid}"
    (dead,) = [t for t in study.get_trials() if t.user_attrs.get("worker", "").endswith(by_doomed)]
    assert dead.state == TrialState.PRUNED and dead.user_attrs["config"] == key
    # The taker-over re-enqueued it once; that copy measured it, or an idle worker's re-plan
    # slipped in a lower-numbered twin first and the copy ended as its duplicate.
    (retry,) = [t for t in study.get_trials() if t.user_attrs.get("retry_of") == dead.number]
    (measured,) = [t for t in done if t.user_attrs["config"] == key]
    assert retry.user_attrs["config"] == key and measured.number > dead.number
    assert retry.state == TrialState.COMPLETE or retry.user_attrs["duplicate_of"] == measured.number


def test_planning_twice_leaves_twins_that_are_pruned_not_measured(url: str) -> None:
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    configs = _configs(6)
    for key, params in configs:  # what two planners racing leave behind
        study.enqueue_trial(params, user_attrs={"config": key})
        study.enqueue_trial(params, user_attrs={"config": key})
    assert claims.plan_cell(study, configs) == 0  # every config already has a live trial
    measured = []
    while (claim := claims.claim_next(study, "me:1", LEASE)) is not None:
        x = claim.trial.suggest_int("x", 0, 5)
        assert claim.finish(float(x), {"pid": 1})
        measured.append(claim.key)
    assert sorted(measured) == sorted(k for k, _ in configs)
    status = claims.status(study)
    assert (status.done, status.waiting, status.duplicates) == (6, 0, 6)
    trials = study.get_trials(deepcopy=False)
    for twin in (t for t in trials if "duplicate_of" in t.user_attrs):
        first = trials[twin.user_attrs["duplicate_of"]]  # the one measured, planned first
        assert first.state == TrialState.COMPLETE and twin.state == TrialState.PRUNED
        assert first.user_attrs["config"] == twin.user_attrs["config"]
        assert first.number < twin.number


def test_a_worker_claims_only_the_configurations_it_accepts(url: str) -> None:
    """A worker whose plan names fewer variants leaves the others' configurations (and trials
    enqueued without a configuration key) waiting for someone else."""
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    claims.plan_cell(study, _configs(4))
    study.enqueue_trial({"x": 9})  # someone else's, with no key

    def only_two(key: str) -> bool:
        return key == '{"x": 2}'

    claim = claims.claim_next(study, "me:1", LEASE, accept=only_two)
    assert claim is not None and claim.key == '{"x": 2}'
    assert claim.finish(2.0)
    assert claims.claim_next(study, "me:1", LEASE, accept=only_two) is None
    still = claims.status(study)
    assert (still.waiting, still.done, still.duplicates) == (3, 1, 0)  # the other three wait
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states.count(TrialState.WAITING) == 4 and states.count(TrialState.COMPLETE) == 1


def test_lease_is_renewed_while_held_and_expires_when_holder_stops(url: str) -> None:
    # A lease 15x its renewal period: the live holder's renewals keep it however slowly a
    # loaded machine schedules them; the silent one expires a few seconds after it stops.
    lease = claims.Lease(seconds=3.0, renew_s=0.2)
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    claims.plan_cell(study, _configs(2))
    alive = claims.claim_next(study, "alive:1", lease)
    silent = claims.claim_next(study, "silent:2", lease)
    assert alive is not None and silent is not None
    silent._end()  # its renewals stop, as if its process froze
    stopped = time.monotonic()
    while claims.status(study, lease).expired == {} and time.monotonic() < stopped + 60:
        time.sleep(0.25)
    assert time.monotonic() - stopped >= lease.seconds - 0.5  # not before its lease ran out
    expired = claims.status(study, lease)
    assert (expired.running, expired.expired) == ({"alive:1": 1}, {"silent:2": 1})
    assert claims.take_over_stale(study, lease) == 1  # only the silent one
    taken = claims.status(study, lease)
    assert (taken.running, taken.expired) == ({"alive:1": 1}, {})
    assert (taken.waiting, taken.retried, taken.done) == (1, 1, 0)
    assert alive.finish(1.0) and not silent.finish(2.0)
    retry = claims.claim_next(study, "other:3", lease)
    assert retry is not None and retry.key == silent.key
    assert retry.trial.user_attrs["retry_of"] == silent.trial.number
    assert retry.trial.user_attrs["retry_why"] == "lease expired"
    assert retry.finish(2.0)
    assert claims.claim_next(study, "other:3", lease) is None


def test_tpe_proposals_are_deduped_and_claimed_once(url: str) -> None:
    sampler = optuna.samplers.TPESampler(seed=0, constant_liar=True, n_startup_trials=2)
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}", sampler)

    def suggest(trial: optuna.Trial) -> tuple[str, dict[str, Any]]:
        x = trial.suggest_int("x", 0, 3)
        return f'{{"x": {x}}}', {"x": x}

    proposed = [claims.propose(study, suggest) for _ in range(12)]
    fresh = [key for key in proposed if key is not None]
    assert len(fresh) == len(set(fresh)) <= 4 and len(fresh) < len(proposed)
    measured = []
    while (claim := claims.claim_next(study, "me:1", LEASE)) is not None:
        assert claim.finish(float(claim.trial.suggest_int("x", 0, 3)))
        measured.append(claim.key)
    assert sorted(measured) == sorted(fresh)


def test_each_proposal_tells_tpe_what_became_of_it(url: str) -> None:
    """A new proposal is enqueued; one already waiting is not enqueued again and ends FAIL (TPE
    ignores it); one measured already ends with its stored value (TPE sees the point again); a
    suggestion that cannot run ends PRUNED and enqueues nothing."""
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")

    def one(trial: optuna.Trial) -> tuple[str, dict[str, Any]]:
        return '{"x": 1}', {"x": 1}

    assert claims.propose(study, one) == '{"x": 1}'
    assert claims.propose(study, one) is None  # waiting already
    claim = claims.claim_next(study, "me:1", LEASE)
    assert claim is not None and claim.key == '{"x": 1}'
    assert claim.finish(float(claim.trial.suggest_int("x", 0, 3)) + 1.5)
    assert claims.claim_next(study, "me:1", LEASE) is None  # enqueued once
    assert claims.propose(study, one) is None  # measured already
    assert claims.propose(study, lambda trial: None) is None

    trials = study.get_trials(deepcopy=False)
    proposals = [t for t in trials if "proposal" in t.user_attrs]
    assert [t.user_attrs["proposal"] for t in proposals] == ['{"x": 1}'] * 3
    assert [t.state for t in proposals] == [TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]
    assert proposals[-1].value == 2.5
    measured = [t for t in trials if t.user_attrs.get("config") == '{"x": 1}']
    assert [(t.state, t.value) for t in measured] == [(TrialState.COMPLETE, 2.5)]
    assert trials[-1].state == TrialState.PRUNED and not trials[-1].user_attrs
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]


def test_each_way_a_claim_ends_is_stored_as_it_says(url: str) -> None:
    """finish(value) is COMPLETE with the value and the attributes, finish(None) is FAIL,
    close(why) is PRUNED with why; a claim taken over by another worker is lost."""
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    configs = _configs(2 * 16 + 3)  # more than one planning chunk
    assert claims.plan_cell(study, configs, spread=False) == len(configs)
    assert claims.plan_cell(study, configs) == 0  # every one live already
    ended = []
    for how in ("measured", "failed", "closed"):
        claim = claims.claim_next(study, "me:1", LEASE, spread=False)
        assert claim is not None and claim.worker == "me:1"
        if how == "measured":
            assert claim.finish(1.25, {"pid": 7})
        elif how == "failed":
            assert claim.finish(None, {"why": "it crashed"})
        else:
            assert claim.close("nothing left to do")
        assert not claim.lost
        ended.append(study.get_trials(deepcopy=False)[claim.trial.number])
    assert [(t.state, t.value) for t in ended] == [
        (TrialState.COMPLETE, 1.25), (TrialState.FAIL, None), (TrialState.PRUNED, None)]
    assert ended[0].user_attrs["pid"] == 7 and ended[1].user_attrs["why"] == "it crashed"
    assert ended[2].user_attrs[claims.CLOSED] == "nothing left to do"
    taken = claims.claim_next(study, "slow:2", LEASE, spread=False)
    assert taken is not None
    taken._end()  # it stops renewing; another worker takes the claim over
    assert claims._take_back(study, study.get_trials()[taken.trial.number], "lease expired")
    assert not taken.finish(2.0) and taken.lost
    assert study.get_trials(deepcopy=False)[taken.trial.number].state == TrialState.PRUNED


def test_one_runner_claims_in_plan_order(url: str) -> None:
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    configs = _configs(8)
    claims.plan_cell(study, configs, spread=False)
    in_order = []
    while (claim := claims.claim_next(study, "me:1", LEASE, spread=False)) is not None:
        with claim:
            claim.finish(0.0, {})
        in_order.append(claim.key)
    assert in_order == [key for key, _ in configs]


def test_ctrl_c_between_the_pop_and_the_claim_gives_the_trial_back(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    claims.plan_cell(study, _configs(1))

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt  # arrives after WAITING->RUNNING, before the claim exists

    monkeypatch.setattr(claims, "Claim", interrupted)
    with pytest.raises(KeyboardInterrupt):
        claims.claim_next(study, "me:1", LEASE)
    popped, again = study.get_trials(deepcopy=False)
    assert (popped.state, again.state) == (TrialState.PRUNED, TrialState.WAITING)  # re-enqueued
    assert again.user_attrs["retry_of"] == popped.number
    assert again.user_attrs["retry_why"] == "released"


def test_a_claim_whose_storage_is_gone_is_left_to_expire(url: str) -> None:
    """An exception inside `with claim` gives the configuration back, unless the storage is
    unreachable: then nothing is written and the lease runs out instead."""
    study = _study(url, f"cell-{uuid.uuid4().hex[:8]}")
    claims.plan_cell(study, _configs(2), spread=False)
    with pytest.raises(ValueError), claims.claim_next(study, "me:1", LEASE, spread=False):
        raise ValueError("the measurement broke")
    gone = claims.claim_next(study, "me:1", LEASE, spread=False)
    assert gone is not None and gone.key == '{"x": 1}'
    with pytest.raises(StorageUnavailable), gone:
        raise StorageUnavailable("the storage went away")
    gone._thread.join(timeout=30)
    assert not gone._thread.is_alive()  # its renewals stopped
    states = {t.user_attrs["config"]: t.state for t in study.get_trials(deepcopy=False)
              if "retry_of" not in t.user_attrs}
    assert states == {'{"x": 0}': TrialState.PRUNED, '{"x": 1}': TrialState.RUNNING}
    (retry,) = [t for t in study.get_trials(deepcopy=False) if "retry_of" in t.user_attrs]
    assert retry.user_attrs["config"] == '{"x": 0}' and retry.state == TrialState.WAITING

"""Interleaved re-measurement: rounds go on while a cell is undecided and its budget lasts; an
in-place contender never disturbs the others' inputs."""

from __future__ import annotations

import random
import time

from conftest import cpu_cell

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm
from fusionlab.measure.rounds import RoundsReply, RoundsTask, StopRule, usable
from fusionlab.measure.timing import TimingSettings
from fusionlab.records import Status

_QUICK = TimingSettings(warmup_s=0.0, budget_s=0.005, min_samples=3, max_samples=5)


def _rounds(contenders: list[str], rule: StopRule) -> RoundsReply:
    task = RoundsTask(
        cell=cpu_cell("add_rmsnorm", (8, 256)),
        contenders=[(name, name, {}) for name in contenders],
        mode="warm",
        rule=rule,
        timing=_QUICK,
    )
    return task.run()


def _samples(median: float, noise: float, rounds: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[median * rng.lognormvariate(0.0, noise) for _ in range(15)] for _ in range(rounds)]


def test_a_decided_cell_stops_after_the_minimum_rounds() -> None:
    rule = StopRule(min_rounds=5, max_rounds=30, budget_s=60.0)
    clear = {"a": _samples(1.0, 0.01, 5, 1), "b": _samples(1.5, 0.01, 5, 2)}
    assert rule.stop(clear, [True] * 5, elapsed_s=1.0, longest_s=0.2) == "decided"
    same = {"a": _samples(1.0, 0.005, 5, 3), "b": _samples(1.0, 0.005, 5, 4)}
    assert rule.stop(same, [True] * 5, elapsed_s=1.0, longest_s=0.2) == "decided"
    fewer = {name: samples[:4] for name, samples in clear.items()}
    assert rule.stop(fewer, [True] * 4, elapsed_s=1.0, longest_s=0.2) is None


def test_an_undecided_cell_goes_on_until_its_budget_or_round_limit() -> None:
    rule = StopRule(min_rounds=5, max_rounds=12, budget_s=10.0)
    noisy = {"a": _samples(1.0, 0.4, 5, 5), "b": _samples(1.1, 0.4, 5, 6)}
    assert rule.stop(noisy, [True] * 5, elapsed_s=1.0, longest_s=0.5) is None
    assert rule.stop(noisy, [True] * 5, elapsed_s=9.6, longest_s=0.5) == "budget"
    # The first rounds always run, as every cell got them before rounds went on.
    first = {name: samples[:3] for name, samples in noisy.items()}
    assert rule.stop(first, [True] * 3, elapsed_s=60.0, longest_s=0.5) is None
    many = {"a": _samples(1.0, 0.4, 12, 5), "b": _samples(1.1, 0.4, 12, 6)}
    assert rule.stop(many, [True] * 12, elapsed_s=1.0, longest_s=0.5) == "max rounds"


def test_disturbed_rounds_do_not_count_and_are_left_out_once_enough_are_quiet() -> None:
    rule = StopRule(min_rounds=3, max_rounds=30, budget_s=60.0)
    rounds = {"a": _samples(1.0, 0.01, 4, 7), "b": _samples(1.5, 0.01, 4, 8)}
    assert rule.stop(rounds, [True, False, True, False], 1.0, 0.1) is None
    assert rule.stop(rounds, [True, False, True, False], 59.95, 0.1) == "budget"
    quiet = [True, False, True, True]
    assert rule.stop(rounds, quiet, 1.0, 0.1) == "decided"
    assert usable(rounds, quiet, 3)["a"] == [rounds["a"][i] for i in (0, 2, 3)]
    assert usable(rounds, [True, False, False, False], 3) == rounds


def test_real_rounds_stop_when_decided() -> None:
    # naive (an ATen chain) against the in-place built-in at 8x256: far apart, decided early.
    outcome = _rounds(["naive", "builtin"], StopRule(min_rounds=3, max_rounds=30, budget_s=60.0))
    rounds = outcome.rounds
    for name, entry in outcome.contenders.items():
        assert entry.status is Status.PASSED, (name, entry.message)
    if rounds.stopped == "decided":  # on at least the 3 quiet rounds the rule needs
        assert rounds.quiet >= 3
    else:  # a noisy machine: the rule went on, within its limits
        assert rounds.stopped in {"settled", "max rounds", "budget"}


@register_variant("rmsnorm", "test-jittery", devices=("cpu",))
def jittery(device_type: str):
    """The naive chain after a random wait of up to 2 ms: right answers, timings too noisy for
    two copies of it ever to be told apart or shown equivalent."""

    def kernel(x, weight, eps):
        time.sleep(random.uniform(0.0, 0.002))
        return naive_rmsnorm(x, weight, eps)

    return kernel


def test_real_rounds_of_an_undecidable_cell_respect_the_budget() -> None:
    budget = 1.5
    task = RoundsTask(
        cell=cpu_cell("rmsnorm", (8, 256)),
        contenders=[("a", "test-jittery", {}), ("b", "test-jittery", {})],
        mode="warm",
        rule=StopRule(min_rounds=2, max_rounds=1000, budget_s=budget),
        timing=_QUICK,
    )
    outcome = task.run()
    rounds = outcome.rounds
    # Two copies of one jittery kernel are rarely decided within 1.5 s: they may be found
    # equivalent (decided) or settle (every interval narrower than the threshold) on a quiet
    # moment; else the budget stops them. Whichever, the budget holds.
    assert rounds.stopped in {"budget", "settled", "decided"}, rounds
    assert 2 < rounds.run < 1000
    longest = max(window.wall_s for window in rounds.windows if window is not None)
    # No round was started past the budget: what it took ends within one round of it, plus the
    # rule's own bootstrap between rounds (a margin that holds on a loaded 2-core machine).
    assert rounds.elapsed_s <= budget + longest + 1.0
    assert len(rounds.windows) == rounds.run


def test_in_place_contender_beside_out_of_place_ones() -> None:
    # The in-place variant overwrites x and the residual with every call; the naive and built-in
    # contenders are timed between its calls and checked against their references each round.
    rule = StopRule(min_rounds=3, max_rounds=3, budget_s=60.0)
    outcome = _rounds(["naive", "builtin-inplace", "builtin"], rule)
    assert outcome.rounds.run == 3
    for name, entry in outcome.contenders.items():
        assert entry.status is Status.PASSED, (name, entry.message)
        assert 0 < len(entry.rounds) <= 3


def test_in_place_contender_first_in_the_order() -> None:
    rule = StopRule(min_rounds=2, max_rounds=2, budget_s=60.0)
    outcome = _rounds(["builtin-inplace", "naive"], rule)
    assert all(e.passed for e in outcome.contenders.values()), outcome

"""Winner decisions on synthetic rounds whose true ratios are known."""

from __future__ import annotations

import json
import random

import pytest

from fusionlab.results import Verdict, classify
from fusionlab.verdict import THRESHOLD, Contender, break_even_calls, decide

ROUNDS, SAMPLES = 5, 20


def _contender(
    name: str,
    kind: str,
    median_ms: float,
    noise: float,
    seed: int,
    first_use_ms: float | None = 1.0,
    drift: list[float] | None = None,
) -> Contender:
    """Log-normal samples around `median_ms`; `drift[r]` scales round r (for all alike)."""
    rng = random.Random(seed)
    scale = drift or [1.0] * ROUNDS
    rounds = [
        [median_ms * scale[r] * rng.lognormvariate(0.0, noise) for _ in range(SAMPLES)]
        for r in range(len(scale))
    ]
    return Contender(name, kind, first_use_ms, rounds)


def test_clearly_faster_and_interval_holds_the_true_ratio() -> None:
    verdict = decide([_contender("compiled", "compiled", 1.10, 0.01, seed=1),
                      _contender("cpp", "custom", 1.00, 0.01, seed=2)])
    assert verdict.ranking == ["cpp", "compiled"]
    assert (verdict.winner, verdict.runner_up, verdict.decision) == ("cpp", "compiled", "faster")
    assert verdict.ci_low > 1 + THRESHOLD
    assert verdict.ci_low <= 1.10 <= verdict.ci_high
    assert verdict.reason.startswith("cpp 1.10x [")
    assert verdict.reason.endswith("faster than compiled")


def test_identical_distributions_are_equivalent_and_the_simpler_kind_wins() -> None:
    verdict = decide([_contender("cpp", "custom", 1.0, 0.01, seed=3),
                      _contender("builtin", "builtin", 1.0, 0.01, seed=4)])
    assert verdict.decision == "equivalent"
    assert set(verdict.equivalent_group) == {"cpp", "builtin"}
    assert verdict.winner == "builtin"
    assert verdict.ci_low >= 1 / (1 + THRESHOLD) and verdict.ci_high <= 1 + THRESHOLD
    assert "builtin preferred as the simpler lowering" in verdict.reason
    assert verdict.reason.startswith("equivalent to cpp (")


def test_too_noisy_to_tell_is_inconclusive_and_names_the_better_point_estimate() -> None:
    # 10% apart with 40% noise per sample and 5 rounds: the interval spans 1.03 and 1/1.03.
    verdict = decide([_contender("builtin", "builtin", 1.1, 0.4, seed=40),
                      _contender("cpp", "custom", 1.0, 0.4, seed=41)])
    assert verdict.decision == "inconclusive"
    assert verdict.ci_low < 1 + THRESHOLD < verdict.ci_high
    assert verdict.winner == verdict.ranking[0]  # the better point estimate, not the simpler
    assert verdict.reason.startswith(f"inconclusive against {verdict.runner_up} (")
    assert f"{verdict.winner} taken as the better point estimate" in verdict.reason


def test_interval_classification_at_the_edges() -> None:
    bar = 1 + THRESHOLD
    assert classify(bar + 0.001, 2.0, THRESHOLD) == "faster"
    assert classify(1 / bar, bar, THRESHOLD) == "equivalent"
    assert classify(0.99, 1.01, THRESHOLD) == "equivalent"
    # may be 3% slower: not shown equivalent
    assert classify(0.99, bar + 0.001, THRESHOLD) == "inconclusive"
    assert classify(1 / bar - 0.001, 1.01, THRESHOLD) == "inconclusive"
    assert classify(0.37, 3.85, THRESHOLD) == "inconclusive"  # the 'tie': cannot tell


def test_same_kind_tie_is_broken_by_first_use_cost() -> None:
    verdict = decide([_contender("cpp-a", "custom", 1.0, 0.01, seed=5, first_use_ms=900.0),
                      _contender("cpp-b", "custom", 1.0, 0.01, seed=6, first_use_ms=2.0)])
    assert verdict.decision == "equivalent"
    assert verdict.winner == "cpp-b"
    assert "lower first-use cost" in verdict.reason


def test_one_percent_apart_is_equivalent() -> None:
    verdict = decide([_contender("cpp", "custom", 1.00, 0.005, seed=7),
                      _contender("compiled", "compiled", 1.01, 0.005, seed=8)])
    assert verdict.decision == "equivalent"
    assert verdict.ci_high < 1 + THRESHOLD
    assert verdict.winner == "compiled"  # simpler than custom, and within the threshold
    assert verdict.runner_up == "cpp"
    assert verdict.ratio == pytest.approx(1.01, abs=0.01)


def test_noisy_but_twenty_percent_apart_is_faster() -> None:
    verdict = decide([_contender("builtin", "builtin", 1.2, 0.15, seed=9),
                      _contender("cpp", "custom", 1.0, 0.15, seed=10)])
    assert verdict.decision == "faster"
    assert verdict.winner == "cpp"
    assert verdict.ci_low > 1 + THRESHOLD
    assert verdict.ci_low <= 1.2 <= verdict.ci_high


def test_same_input_gives_the_same_interval() -> None:
    contenders = [
        _contender("cpp", "custom", 1.0, 0.05, seed=11),
        _contender("compiled", "compiled", 1.05, 0.05, seed=12),
    ]
    assert decide(contenders) == decide(list(contenders))


def test_drift_shared_by_a_round_does_not_change_the_ranking() -> None:
    drift = [1.0, 1.6, 0.8, 2.0, 1.3]  # each round is slower or faster for every contender alike
    verdict = decide([_contender("compiled", "compiled", 1.08, 0.01, seed=13, drift=drift),
                      _contender("cpp", "custom", 1.00, 0.01, seed=14, drift=drift)])
    assert verdict.ranking == ["cpp", "compiled"]
    assert verdict.decision == "faster"  # pairing by round cancels the drift in the ratio
    assert verdict.ci_low <= 1.08 <= verdict.ci_high
    assert verdict.ci_high - verdict.ci_low < 0.05


def test_equivalent_group_among_three_holds_only_those_within_the_threshold() -> None:
    verdict = decide([
        _contender("cpp", "custom", 1.00, 0.005, seed=15, first_use_ms=50.0),
        _contender("compiled", "compiled", 1.01, 0.005, seed=16, first_use_ms=3000.0),
        _contender("builtin", "builtin", 1.25, 0.005, seed=17),
    ])
    assert verdict.ranking == ["cpp", "compiled", "builtin"]
    assert verdict.decision == "equivalent"
    assert set(verdict.equivalent_group) == {"cpp", "compiled"}
    assert verdict.winner == "compiled"
    assert verdict.versus_fastest["builtin"][1] > 1 + THRESHOLD


def test_runner_up_is_the_inconclusive_contender_not_the_clearly_slower_second() -> None:
    verdict = decide([
        _contender("builtin", "builtin", 1.00, 0.005, seed=26),
        _contender("cpp", "custom", 1.06, 0.005, seed=27),  # second fastest, clearly slower
        _contender("compiled", "compiled", 1.15, 0.40, seed=29),  # too noisy to rule out
    ])
    assert verdict.ranking[:2] == ["builtin", "cpp"]
    assert verdict.decision == "inconclusive"
    assert verdict.equivalent_group == ["builtin"]
    assert (verdict.winner, verdict.runner_up) == ("builtin", "compiled")
    assert verdict.reason.startswith("inconclusive against compiled (")


def test_single_contender_wins_alone() -> None:
    verdict = decide([_contender("cpp", "custom", 1.0, 0.01, seed=18)])
    assert (verdict.winner, verdict.runner_up, verdict.decision) == ("cpp", None, "only contender")


def test_unpaired_rounds_are_refused() -> None:
    short = Contender("b", "builtin", 1.0, [[1.0]] * (ROUNDS - 1))
    with pytest.raises(ValueError, match="share their rounds"):
        decide([_contender("a", "custom", 1.0, 0.01, seed=19), short])


def test_verdict_round_trips_through_a_plain_dict() -> None:
    verdict = decide([_contender("cpp", "custom", 1.0, 0.02, seed=20),
                      _contender("compiled", "compiled", 1.1, 0.02, seed=21)])
    assert Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))) == verdict


def test_break_even_calls() -> None:
    # a: 100 ms to build, 1 ms a call; b: free to build, 2 ms a call -> even after 100 calls.
    assert break_even_calls(100.0, 1.0, 0.0, 2.0) == pytest.approx(100.0)
    assert break_even_calls(0.0, 1.0, 100.0, 2.0) == 0.0
    assert break_even_calls(0.0, 2.0, 100.0, 1.0) is None  # cheaper at first, never after
    assert break_even_calls(5.0, 1.0, 10.0, 1.0) == 0.0
    assert break_even_calls(10.0, 1.0, 5.0, 1.0) is None


def test_latency_is_the_median_of_the_round_medians_worked_by_hand() -> None:
    # Round medians, odd and even sample counts: 2.0, 3.5, 5.0, 2.0, 6.0 -> their median 3.5.
    rounds = [[9.0, 1.0, 2.0], [1.0, 8.0, 3.0, 4.0], [5.0], [2.0, 2.0], [6.0]]
    verdict = decide([Contender("only", "custom", 1.0, rounds)])
    assert verdict.latency_ms == {"only": 3.5}
    assert (verdict.ranking, verdict.winner, verdict.runner_up) == (["only"], "only", None)
    assert verdict.equivalent_group == ["only"]
    assert verdict.decision == "only contender"
    slower = Contender("slower", "custom", 1.0, [[3 * v for v in r] for r in rounds])
    pair = decide([slower, Contender("only", "custom", 1.0, rounds)])
    assert pair.latency_ms == {"only": 3.5, "slower": 10.5}
    assert pair.winner == "only" and pair.ratio == pytest.approx(3.0)


def test_a_tie_goes_to_the_contender_whose_first_use_is_known() -> None:
    verdict = decide([_contender("unknown", "custom", 1.0, 0.03, seed=43, first_use_ms=None),
                      _contender("known", "custom", 1.0, 0.03, seed=44, first_use_ms=500.0)])
    assert verdict.decision == "equivalent" and verdict.winner == "known"


def test_contenders_without_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="no contenders"):
        decide([])
    empty_round = Contender("b", "builtin", 1.0, [[1.0]] * (ROUNDS - 1) + [[]])
    with pytest.raises(ValueError, match="b: every round needs at least one sample"):
        decide([_contender("a", "custom", 1.0, 0.01, seed=40), empty_round])


def test_an_unknown_kind_ranks_after_every_known_one_in_a_tie() -> None:
    verdict = decide([_contender("mystery", "hand-rolled", 1.0, 0.03, seed=41),
                      _contender("cpp", "custom", 1.0, 0.03, seed=42)])
    assert verdict.decision == "equivalent" and verdict.winner == "cpp"


def test_break_even_divides_the_first_use_gap_by_the_latency_gap() -> None:
    assert break_even_calls(100.0, 1.0, 0.0, 5.0) == pytest.approx(25.0)
    assert break_even_calls(5.0, 1.0, 5.0, 1.0) is None  # never strictly cheaper

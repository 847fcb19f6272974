"""A cell's verdict from interleaved re-measurement rounds: `faster`, `equivalent` or
`inconclusive`, with a bootstrap interval.

Each contender is measured in R rounds; round r measures every contender once (rotated order), so
drift over the run (clock, thermals, other processes) hits all contenders alike in that round.
The round is therefore the unit of replication:

* latency = the median of the round medians (each round weighs the same whatever its sample
  count, and a disturbed round moves it by at most one rank; the estimator mirrors the resampling);
* the interval of a ratio (contender / fastest) is a paired bootstrap: each resample draws R round
  indices with replacement, the SAME indices for every contender (so a slow round is slow for
  both sides of the ratio), and a within-round resampled median for each drawn round; percentile
  interval, fixed seed, so the same data always gives the same interval;
* each contender against the fastest is `faster` (the fastest is faster: the interval lies above
  1 + THRESHOLD), `equivalent` (the interval lies inside [1/(1 + THRESHOLD), 1 + THRESHOLD]: the
  two one-sided tests both reject a gap larger than THRESHOLD) or `inconclusive` (neither: the
  data cannot tell);
* the cell: `faster` when every other contender is, `inconclusive` when any is, else `equivalent`.
  The winner is the fastest point estimate unless a contender equivalent to it is preferred: the
  simpler kind of lowering, then the lower first-use cost, then the faster median. An
  inconclusive cell still names that winner (the better point estimate) and says why it is not sure.

Within-round medians are drawn from a per-(contender, round) bank of BANK bootstrap medians,
built once, so the outer loop stays pure Python and fast (< 50 ms for 3 x 5 x 20 samples).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from fusionlab.plausible import ratio_problem
from fusionlab.results import Decision, Verdict, classify

THRESHOLD = 0.03
"""Gaps under 3% are not worth a more complex lowering, and run-to-run drift on shared machines
is of that order: a ratio shown inside [1/1.03, 1.03] is `equivalent`, above 1.03 `faster`."""

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
BANK = 128

KIND_ORDER: tuple[str, ...] = ("builtin", "baseline", "compiled", "custom")
"""Preference among equivalent contenders, simplest lowering first; unknown kinds rank last."""


@dataclass(frozen=True)
class Contender:
    """A variant's cell measurements: `rounds[r]` holds its per-call samples (ms) in round r."""

    name: str
    kind: str
    first_use_ms: float | None
    rounds: Sequence[Sequence[float]]


def cell_decision(outcomes: Sequence[Decision]) -> Decision:
    """The cell's outcome from each other contender's against the fastest."""
    if not outcomes:
        return Decision.ONLY
    if Decision.INCONCLUSIVE in outcomes:
        return Decision.INCONCLUSIVE
    return Decision.EQUIVALENT if Decision.EQUIVALENT in outcomes else Decision.FASTER


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _latency(contender: Contender) -> float:
    return _median([_median(samples) for samples in contender.rounds])


def _validate(contenders: Sequence[Contender]) -> int:
    if not contenders:
        raise ValueError("no contenders to decide between")
    names = [c.name for c in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names repeat: {names}")
    counts = {len(c.rounds) for c in contenders}
    if len(counts) != 1:
        raise ValueError(f"contenders must share their rounds (paired); round counts {counts}")
    for contender in contenders:
        if not contender.rounds or any(not samples for samples in contender.rounds):
            raise ValueError(f"{contender.name}: every round needs at least one sample")
    return counts.pop()


def _banks(contenders: Sequence[Contender], rng: random.Random) -> list[list[list[float]]]:
    """bank[c][r]: BANK bootstrap medians of contender c's samples in round r."""
    banks = []
    for contender in contenders:
        per_round = []
        for samples in contender.rounds:
            values = list(samples)
            k = len(values)
            per_round.append([_median(rng.choices(values, k=k)) for _ in range(BANK)])
        banks.append(per_round)
    return banks


def _intervals(
    contenders: Sequence[Contender], fastest: int, rounds: int
) -> dict[str, list[float]]:
    """Percentile interval of latency(c) / latency(fastest) for every other contender c."""
    rng = random.Random(SEED)
    banks = _banks(contenders, rng)
    others = [i for i in range(len(contenders)) if i != fastest]
    ratios: dict[int, list[float]] = {i: [] for i in others}
    randrange = rng.randrange
    for _ in range(RESAMPLES):
        drawn = [randrange(rounds) for _ in range(rounds)]
        stats = [_median([bank[r][randrange(BANK)] for r in drawn]) for bank in banks]
        for i in others:
            ratios[i].append(stats[i] / stats[fastest])
    tail = (1 - CONFIDENCE) / 2
    result = {}
    for i, values in ratios.items():
        values.sort()
        low = values[math.floor(tail * (RESAMPLES - 1))]
        high = values[math.ceil((1 - tail) * (RESAMPLES - 1))]
        point = _latency(contenders[i]) / _latency(contenders[fastest])
        result[contenders[i].name] = [point, low, high]
    return result


def paired_ratio(winner: Contender, other: Contender) -> list[float]:
    """[ratio, low, high] of latency(other) / latency(winner), both measured in the same rounds:
    the paired bootstrap interval of the verdict, for a contender that does not decide (a
    baseline measured alongside)."""
    rounds = _validate([winner, other])
    return _intervals([winner, other], 0, rounds)[other.name]


def _kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def _preference(contender: Contender, latency: float) -> tuple[int, float, float]:
    first_use = math.inf if contender.first_use_ms is None else contender.first_use_ms
    return (_kind_rank(contender.kind), first_use, latency)


def _why(winner: Contender, other: Contender, latency: dict[str, float]) -> str:
    """Which preference rule put the winner ahead of `other`."""
    if _kind_rank(winner.kind) < _kind_rank(other.kind):
        return f"{winner.name} preferred as the simpler lowering ({winner.kind} < {other.kind})"
    mine = _preference(winner, latency[winner.name])[1]
    theirs = _preference(other, latency[other.name])[1]
    if mine < theirs:
        shown = "unknown" if math.isinf(theirs) else f"{theirs:.3g}"
        return (f"{winner.name} preferred for its lower first-use cost "
                f"({mine:.3g} ms vs {shown} ms)")
    return f"{winner.name} preferred as the faster median"


def _fmt(ratio: float, low: float, high: float) -> str:
    return f"{ratio:.2f}x [{low:.2f}, {high:.2f}]"


def outcomes(contenders: Sequence[Contender]) -> tuple[list[int], dict[str, list[float]],
                                                        dict[str, Decision]]:
    """Indices fastest first, each other contender's [ratio, low, high] to the fastest, and its
    outcome against the fastest."""
    rounds = _validate(contenders)
    latency = [_latency(c) for c in contenders]
    order = sorted(range(len(contenders)), key=lambda i: latency[i])
    if len(contenders) == 1:
        return order, {}, {}
    versus = _intervals(contenders, order[0], rounds)
    return order, versus, {
        name: classify(low, high, THRESHOLD) for name, (_, low, high) in versus.items()
    }


def settled(contenders: Sequence[Contender]) -> bool:
    """Whether more rounds are not needed: no contender is inconclusive against the fastest."""
    return Decision.INCONCLUSIVE not in outcomes(contenders)[2].values()


def decide(contenders: Sequence[Contender]) -> Verdict:
    """Rank by latency, bootstrap each ratio to the fastest, classify, and pick the winner."""
    order, versus, outcome = outcomes(contenders)
    latency = {c.name: _latency(c) for c in contenders}
    ranking = [contenders[i].name for i in order]
    fastest = contenders[order[0]]
    if len(contenders) == 1:
        return _verdict(ranking, latency, fastest.name, None, None, Decision.ONLY,
                        [fastest.name], "only contender")
    others = [contenders[i] for i in order[1:]]
    group = [fastest] + [c for c in others if outcome[c.name] == Decision.EQUIVALENT]
    winner = min(group, key=lambda c: _preference(c, latency[c.name]))
    decision = cell_decision(list(outcome.values()))
    unsure = [c for c in others if outcome[c.name] == Decision.INCONCLUSIVE]
    partners = [c for c in group if c is not winner]
    if decision == Decision.INCONCLUSIVE:
        runner_up = unsure[0]
    elif partners:
        runner_up = partners[0]
    else:
        runner_up = others[0]
    slower = winner if runner_up is fastest else runner_up
    ratio, low, high = versus[slower.name]
    bar = 1 + THRESHOLD
    if decision == Decision.FASTER:
        reason = f"{winner.name} {_fmt(ratio, low, high)} faster than {runner_up.name}"
    elif decision == Decision.EQUIVALENT:
        reason = (f"equivalent to {runner_up.name} ({_fmt(ratio, low, high)} inside "
                  f"[{1 / bar:.2f}, {bar:.2f}]): {_why(winner, runner_up, latency)}")
    else:
        reason = (f"inconclusive against {runner_up.name} ({_fmt(ratio, low, high)} is neither "
                  f"above {bar:.2f} nor inside [{1 / bar:.2f}, {bar:.2f}]): {winner.name} taken "
                  "as the better point estimate; more rounds or a quieter machine would decide")
    return _verdict(ranking, latency, winner.name, runner_up.name, (ratio, low, high), decision,
                    [c.name for c in group], reason, versus)


def _verdict(
    ranking: list[str],
    latency: dict[str, float],
    winner: str,
    runner_up: str | None,
    interval: tuple[float, float, float] | None,
    decision: Decision,
    group: list[str],
    reason: str,
    versus: dict[str, list[float]] | None = None,
) -> Verdict:
    """The verdict with the settings that made it (confidence, threshold, resamples, seed)."""
    ratio, low, high = interval or (None, None, None)
    return Verdict(
        ranking=ranking, latency_ms=latency, winner=winner, runner_up=runner_up, ratio=ratio,
        ci_low=low, ci_high=high, decision=decision, equivalent_group=group, reason=reason,
        confidence=CONFIDENCE, threshold=THRESHOLD, resamples=RESAMPLES, seed=SEED,
        versus_fastest=versus or {},
    )


def implausible(verdict: Verdict) -> str:
    """Why a ratio of the verdict cannot be a kernel's doing ("" when every one can): two
    lowerings of one memory-bound op read and write the same bytes, so a gap beyond
    plausible.MAX_RATIO comes from timings other processes disturbed."""
    ratios = {f"{verdict.winner} over {verdict.runner_up}": verdict.ratio}
    ratios |= {f"{name} over {verdict.winner}": r[0] for name, r in verdict.versus_winner.items()}
    return next((problem for what, ratio in ratios.items()
                 if ratio is not None and (problem := ratio_problem(ratio, what))), "")


def break_even_calls(
    first_use_a: float, latency_a: float, first_use_b: float, latency_b: float
) -> float | None:
    """Calls after which a's total cost (first use + calls x latency) stays below b's.

    0.0 when a is cheaper from the first call on; None when a never stays cheaper.
    """
    if latency_a < latency_b:
        return max(0.0, (first_use_a - first_use_b) / (latency_b - latency_a))
    if latency_a == latency_b and first_use_a < first_use_b:
        return 0.0
    return None

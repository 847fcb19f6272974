"""Re-measuring a cell's contenders in interleaved rounds until the data decides.

Every round times every contender once, in an order rotated by the round, with the same gated
timing loop as a trial, and watches what else ran meanwhile (measure/disturbance.py). Rounds go
on while the cell is `inconclusive` (verdict.py) and its time budget lasts (`StopRule`).
Runs in the worker process."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fusionlab.cell import Cell
from fusionlab.measure import disturbance
from fusionlab.measure.audit import audit_contenders
from fusionlab.measure.correctness import GateFailure
from fusionlab.measure.disturbance import Disturbance
from fusionlab.measure.inputs import WARM_SETS
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import Measured, build_and_gate, describe, timed_and_checked
from fusionlab.records import Status, Timing
from fusionlab.verdict import THRESHOLD, Contender, outcomes

Rounds = Sequence[Sequence[float]]


@dataclass(frozen=True)
class StopRule:
    """When a cell's re-measurement stops (as nvbench: decided, or precise enough, or out of time).

    The first `min_rounds` rounds always run (what every cell got before rounds went on). Then,
    while fewer than `min_rounds` rounds are quiet (no disturbance hit them: a disturbed round is
    measured again) or the cell is undecided (a contender is `inconclusive` against the fastest)
    and not settled (every interval narrower than the threshold: the ratio sits on it, more
    rounds will not move it off), another round runs, unless it would end past `budget_s`
    (judged by the longest round so far) or make more than `max_rounds`.
    """

    min_rounds: int = 5
    max_rounds: int = 30
    budget_s: float = 3.0

    def stop(
        self, rounds: dict[str, Rounds], quiet: list[bool], elapsed_s: float, longest_s: float
    ) -> str | None:
        """Why to stop before the next round, or None to measure another."""
        done = len(quiet)
        if done < self.min_rounds:
            return None
        if done and sum(quiet) >= self.min_rounds:
            used = usable(rounds, quiet, self.min_rounds)
            _, versus, outcome = outcomes(
                [Contender(label, "", None, samples) for label, samples in used.items()]
            )
            if "inconclusive" not in outcome.values():
                return "decided"
            if all((high - low) / point < THRESHOLD for point, low, high in versus.values()):
                return "settled"
        if elapsed_s + longest_s > self.budget_s:
            return "budget"
        if done >= self.max_rounds:
            return "max rounds"
        return None


def usable(rounds: dict[str, Rounds], quiet: list[bool], min_rounds: int) -> dict[str, Rounds]:
    """The rounds a verdict uses: the quiet ones when there are `min_rounds` of them, else all."""
    if sum(quiet) < min_rounds:
        return rounds
    return {label: [r for r, ok in zip(samples, quiet, strict=True) if ok]
            for label, samples in rounds.items()}


@dataclass
class ContenderRounds:
    """One contender's outcome of the rounds: its status (a failed build, gate or audit is kept
    with its message), the samples of the rounds a verdict uses, and its audit's wall time."""

    status: Status = Status.PASSED
    message: str = ""
    rounds: list[list[float]] = field(default_factory=list)
    audit_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED

    def fail(self, status: Status, message: str) -> None:
        self.status, self.message = status, message


@dataclass(frozen=True)
class RoundsSummary:
    """How the rounds went: how many ran, how many a disturbance hit, why they stopped, their
    wall time (the rounds alone; each contender's audit_s apart), and what other processes did
    in each (None where unreadable)."""

    run: int
    disturbed: int
    stopped: str
    elapsed_s: float
    windows: list[Disturbance | None] = field(default_factory=list)

    @property
    def quiet(self) -> int:
        return self.run - self.disturbed

    def stored(self) -> dict[str, Any]:
        """The figures a verdict stores (its `rounds`), windows left out."""
        return {"run": self.run, "disturbed": self.disturbed, "stopped": self.stopped,
                "elapsed_s": self.elapsed_s}


@dataclass(frozen=True)
class RoundsReply:
    """What a RoundsTask gives back: each contender's outcome, by label, and the rounds."""

    contenders: dict[str, ContenderRounds]
    rounds: RoundsSummary


@dataclass(frozen=True)
class RoundsTask:
    """Contenders of one cell as (label, variant, params), timed in interleaved rounds."""

    cell: Cell
    contenders: list[tuple[str, str, dict[str, Any]]]
    mode: str
    rule: StopRule = field(default_factory=StopRule)
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    decided_ms: dict[str, float] = field(default_factory=dict)  # search latency, by label
    # labels measured in every round beside the others, for paired ratios, that decide nothing
    references: tuple[str, ...] = ()

    def run(self) -> RoundsReply:
        return run_rounds(self)

    def failed(self, status: Status, message: str) -> RoundsReply:
        return RoundsReply(
            {label: ContenderRounds(status, message) for label, _, _ in self.contenders},
            RoundsSummary(run=0, disturbed=0, stopped=status.value, elapsed_s=0.0),
        )


Built = dict[str, tuple[Measured, int]]


def _build(task: RoundsTask, results: dict[str, ContenderRounds]) -> Built:
    """Build and gate every contender once; a failure becomes its outcome."""
    built: Built = {}
    for label, variant, params in task.contenders:
        results[label] = outcome = ContenderRounds()
        try:
            measured, *_ = build_and_gate(task.cell, variant, params, task.seed, reset=not built)
            count = WARM_SETS
            if task.mode == "cold":
                count = max(WARM_SETS, measured.sets.cold_count(measured.device.cache_bytes())[0])
            built[label] = (measured, count)
        except GateFailure as failure:
            outcome.fail(failure.status, str(failure))
        except Exception as error:
            outcome.fail(Status.RUNTIME_ERROR, describe(error))
    return built


def _timed(task: RoundsTask, measured: Measured, count: int) -> Timing:
    """One contender's timing in one round: the gated timing loop of a trial."""
    cold = task.mode == "cold"
    return timed_and_checked(measured, count, task.timing, cold)


def _one_round(
    task: RoundsTask, order: list[str], shift: int, built: Built,
    results: dict[str, ContenderRounds],
) -> None:
    """Time every passing contender once, in the order rotated by `shift`."""
    for label in order[shift:] + order[:shift]:
        outcome = results[label]
        if not outcome.passed:
            continue
        measured, count = built[label]
        try:
            timing = _timed(task, measured, count)
        except GateFailure as failure:
            outcome.fail(failure.status, str(failure))
            continue
        outcome.rounds.append(timing.samples_ms)


def _keep_usable(results: dict[str, ContenderRounds], quiet: list[bool], min_rounds: int) -> None:
    """Every contender that took part in all rounds keeps the rounds a verdict uses."""
    for outcome in results.values():
        if outcome.passed and len(outcome.rounds) == len(quiet):
            outcome.rounds = list(usable({"": outcome.rounds}, quiet, min_rounds)[""])


def _audit(task: RoundsTask, built: Built, results: dict[str, ContenderRounds]) -> None:
    """The gate on the rounds and the audit of every contender: one place. The references (the
    op's own baseline and built-in) decide nothing: no audit for them. The audit takes and
    updates plain entries; their outcome comes back into `results`."""
    deciding = {label: entry for label, entry in built.items() if label not in task.references}
    entries = {label: {"status": outcome.status.value, "message": outcome.message,
                       "rounds": outcome.rounds} for label, outcome in results.items()}
    audit_contenders(deciding, entries, task.mode, task.timing, task.decided_ms)
    for label, entry in entries.items():
        outcome = results[label]
        outcome.status, outcome.message = Status(entry["status"]), entry["message"]
        outcome.audit_s = entry.get("audit_s", 0.0)


def run_rounds(task: RoundsTask) -> RoundsReply:
    """Per contender its status and the samples of the rounds a verdict uses; and the rounds:
    how many ran, how many a disturbance hit, why they stopped, their wall time."""
    results: dict[str, ContenderRounds] = {}
    built = _build(task, results)
    order = list(built)
    quiet: list[bool] = []
    windows: list[Disturbance | None] = []
    start, longest, stopped = time.perf_counter(), 0.0, "no contender passed"
    while order:
        passing = [label for label in order
                   if results[label].passed and label not in task.references]
        current = {label: results[label].rounds for label in passing}
        elapsed = time.perf_counter() - start
        reason = task.rule.stop(current, quiet, elapsed, longest) if passing else "all failed"
        if reason is not None:
            stopped = reason
            break
        watch, began = disturbance.Watch(), time.perf_counter()
        _one_round(task, order, len(quiet) % len(order), built, results)
        longest = max(longest, time.perf_counter() - began)
        seen = watch.stop()
        windows.append(seen)
        quiet.append(seen is None or not seen.disturbed)
    _keep_usable(results, quiet, task.rule.min_rounds)
    elapsed_s = time.perf_counter() - start
    _audit(task, built, results)
    summary = RoundsSummary(len(quiet), quiet.count(False), stopped, elapsed_s, windows)
    return RoundsReply(results, summary)

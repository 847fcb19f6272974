"""Re-measuring a cell's contenders in interleaved rounds, so drift hits all of them alike.

Every round times every contender once, in an order rotated by the round, with the same gated
timing loop as a trial. Runs in the worker process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fusionlab.cell import Cell
from fusionlab.measure.audit import audit_contenders
from fusionlab.measure.correctness import GateFailure
from fusionlab.measure.inputs import WARM_SETS
from fusionlab.measure.timing import TimingSettings
from fusionlab.measure.trial import Measured, build_and_gate, describe, timed_and_checked
from fusionlab.records import Status


@dataclass(frozen=True)
class RoundsTask:
    """Contenders of one cell as (label, variant, params), timed in `rounds` interleaved rounds."""

    cell: Cell
    contenders: list[tuple[str, str, dict[str, Any]]]
    mode: str
    rounds: int
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    decided_ms: dict[str, float] = field(default_factory=dict)  # search latency, by label

    def run(self) -> dict[str, Any]:
        return run_rounds(self)

    def failed(self, status: Status, message: str) -> dict[str, Any]:
        return {
            label: {"status": status.value, "message": message, "rounds": []}
            for label, _, _ in self.contenders
        }


def run_rounds(task: RoundsTask) -> dict[str, Any]:
    """Per contender: its status, and the samples of every round it was timed in."""
    results: dict[str, dict[str, Any]] = {}
    built: dict[str, tuple[Measured, int]] = {}
    for label, variant, params in task.contenders:
        results[label] = {"status": Status.PASSED.value, "message": "", "rounds": []}
        try:
            measured, *_ = build_and_gate(task.cell, variant, params, task.seed, reset=not built)
            count = WARM_SETS
            if task.mode == "cold":
                count = max(WARM_SETS, measured.sets.cold_count(measured.device.cache_bytes())[0])
            built[label] = (measured, count)
        except GateFailure as failure:
            results[label].update(status=failure.status.value, message=str(failure))
        except Exception as error:
            results[label].update(status=Status.RUNTIME_ERROR.value, message=describe(error))
    order = list(built)
    for round_index in range(task.rounds):
        shift = round_index % max(len(order), 1)
        for label in order[shift:] + order[:shift]:
            if results[label]["status"] != Status.PASSED.value:
                continue
            measured, count = built[label]
            try:
                cold = task.mode == "cold"
                timing = timed_and_checked(measured, count, task.timing, cold)
            except GateFailure as failure:
                results[label].update(status=failure.status.value, message=str(failure))
                continue
            results[label]["rounds"].append(timing.samples_ms)
    # The gate on the rounds and the audit of every contender: one place (issue 15).
    audit_contenders(built, results, task.mode, task.timing, task.decided_ms)
    return results

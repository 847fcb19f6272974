"""One decision for tables, exports and the Dispatcher: the stored verdict, --calls, in place."""

from __future__ import annotations

import pytest
from conftest import cpu_cell

from fusionlab.records import Status, Timing, TrialRecord
from fusionlab.report.tables import best_row, display_rows
from fusionlab.results import CellResult, Decision, OutOfPlace, Verdict
from fusionlab.winners import break_even, cell_winner


def _record(variant: str, latency_ms: float, first_use_ms: float, op: str = "rmsnorm"):
    timing = Timing(latency_ms, latency_ms * 0.99, latency_ms * 1.01, latency_ms * 0.98, 0.01,
                    1, [latency_ms] * 10)
    return TrialRecord(cpu_cell(op, (4, 64)), variant, {}, Status.PASSED, setup_ms=0.0,
                       first_call_ms=first_use_ms, timing=timing, cold=timing,
                       bytes_moved=4 * 64 * 8)


def test_calls_weigh_first_use_against_latency() -> None:
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)),
                      [_record("compiled", 0.010, 2000.0), _record("naive", 0.030, 0.5)])
    assert cell_winner(cell).record.variant == "compiled"
    assert cell_winner(cell, calls=1000).record.variant == "naive"
    assert cell_winner(cell, calls=1_000_000).record.variant == "compiled"
    compiled, naive = cell.records
    assert break_even(compiled, naive, cell, "cold") == pytest.approx((2000.0 - 0.5) / 0.020)
    row = best_row(cell, calls=1000)
    assert row.variant == "naive" and row.decision is Decision.BY_COST


def test_stored_verdict_decides_over_the_raw_fastest() -> None:
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)),
                      [_record("compiled", 0.0100, 900.0), _record("builtin", 0.0101, 0.2)])
    cell.verdicts["cold"] = Verdict(
        ranking=["compiled", "builtin"], latency_ms={"compiled": 0.0100, "builtin": 0.0101},
        winner="builtin", runner_up="compiled", ratio=1.01, ci_low=0.99, ci_high=1.03,
        decision=Decision.EQUIVALENT, equivalent_group=["compiled", "builtin"],
        reason="equivalent to compiled: builtin preferred", confidence=0.95, threshold=0.03,
        resamples=2000, seed=0)
    assert cell_winner(cell).record.variant == "builtin"
    row = best_row(cell)
    assert row.variant == row.label == "builtin" and row.decision == "equivalent"
    assert (row.ratio, row.ci_low, row.ci_high) == (1.01, 0.99, 1.03)
    assert display_rows([row], "rmsnorm")[0]["runner-up/winner [95% CI]"] == "1.01x [0.99, 1.03]"


@pytest.mark.parametrize(
    ("low", "high", "decision"),
    [(0.99, 1.03, "equivalent"), (0.37, 3.85, "inconclusive"), (1.5, 2.0, "faster")],
)
def test_a_verdict_stored_as_a_tie_is_classified_from_its_interval(
    low: float, high: float, decision: str
) -> None:
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)),
                      [_record("compiled", 0.0100, 900.0), _record("builtin", 0.0101, 0.2)])
    # As version 1 stored it: no schema, `tie` and `tie_group` in place of a decision.
    cell.verdicts["cold"] = Verdict.from_dict({
        "ranking": ["compiled", "builtin"], "latency_ms": {"compiled": 0.0100, "builtin": 0.0101},
        "winner": "builtin", "runner_up": "compiled", "ratio": 1.01, "ci_low": low,
        "ci_high": high, "tie": low < 1.03, "tie_group": ["compiled", "builtin"],
        "reason": "old", "versus_fastest": {"builtin": [1.01, low, high]}, "confidence": 0.95,
        "threshold": 0.03, "resamples": 2000, "seed": 0})
    assert best_row(cell).decision == decision


def test_in_place_winner_is_kept_from_callers_that_keep_their_inputs() -> None:
    cell = CellResult(cpu_cell("add_rmsnorm", (4, 64)),
                      [_record("builtin-inplace", 0.01, 0.1, "add_rmsnorm"),
                       _record("builtin", 0.02, 0.1, "add_rmsnorm")])
    assert cell_winner(cell).record.variant == "builtin-inplace"
    assert cell_winner(cell, allow_inplace=False).record.variant == "builtin"
    row = best_row(cell)
    assert row.label == "builtin-inplace (in place)" and row.variant == "builtin-inplace"
    assert row.inplace and row.out_of_place == OutOfPlace("builtin", {})

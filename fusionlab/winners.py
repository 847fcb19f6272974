"""A cell's winner, decided one way for tables, exports and the Dispatcher.

The stored verdict (contenders re-measured in interleaved rounds, a bootstrap interval, `faster`,
`equivalent` or `inconclusive`, equivalent contenders by a declared preference) decides; a cell
measured without re-measurement falls back to the fastest median. With `calls`, the cost of first
use counts: first use + calls x latency. With a memory budget (passes with a backward), only
configurations whose memory footprint fits it compete: the verdict stands if its winner fits,
else the fastest median that fits wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionlab.records import TrialRecord
from fusionlab.registry import variants_of
from fusionlab.results import CellResult, Decision, Verdict
from fusionlab.verdict import break_even_calls


@dataclass(frozen=True)
class Ranking:
    """How a cell's configurations are ranked: by a rank mode's latency, or by first use +
    `calls` x latency, and only those within a memory budget (passes with a backward)."""

    mode: str
    calls: int | None = None
    budget_mb: float | None = None

    @classmethod
    def of(cls, cell: CellResult, mode: str, calls: int | None = None,
           memory_budget_mb: float | None = None) -> Ranking:
        """The ranking of this cell: a memory budget applies to the cells of passes with a
        backward (their records carry memory), not to forward cells."""
        budget = memory_budget_mb if cell.cell.pass_name != "forward" else None
        return cls(mode, calls, budget)

    def label(self) -> str:
        """As tables and exports show it."""
        text = self.mode if self.calls is None else f"{self.mode} + {self.calls} calls x latency"
        if self.budget_mb is None:
            return text
        return f"{text}, saved + peak <= {self.budget_mb:g} MB"


@dataclass(frozen=True)
class Winner:
    """The chosen record, its runner-up, and the verdict that chose it (None: search only)."""

    record: TrialRecord
    runner_up: TrialRecord | None
    verdict: Verdict | None
    ranked_by: Ranking

    @property
    def decision(self) -> Decision:
        """The verdict's outcome, or how the winner was ranked without one (by cost, or the
        fastest median when not re-measured)."""
        if self.verdict is None:
            if self.ranked_by.calls is not None:
                return Decision.BY_COST
            if self.ranked_by.budget_mb is not None:
                return Decision.WITHIN_BUDGET
            return Decision.NOT_REMEASURED
        return self.verdict.decision


def _cost(record: TrialRecord, mode: str, calls: int, first_use: dict[str, float]) -> float:
    latency = record.latency_ms(mode) or float("inf")
    return first_use.get(record.variant, record.first_use_ms or 0.0) + calls * latency


def first_use_by_variant(cell: CellResult) -> dict[str, float]:
    """The largest first-use cost each variant paid in this cell (its build or compile)."""
    costs: dict[str, float] = {}
    for record in cell.records:
        if record.first_use_ms is not None:
            costs[record.variant] = max(costs.get(record.variant, 0.0), record.first_use_ms)
    return costs


def footprint_mb(record: TrialRecord) -> float | None:
    """The most memory a pass with a backward held at once beyond its inputs, in MB: the
    forward's peak, or the saved tensors plus the backward's own peak if more (both peaks are
    counted from what was live when each pass began); None for a record without memory."""
    memory = record.memory
    if memory is None:
        return None
    return max(memory.forward_peak_bytes, memory.saved_bytes + memory.backward_peak_bytes) / 1e6


def _fitting_per_variant(cell: CellResult, mode: str, budget_mb: float) -> dict[str, TrialRecord]:
    """Each variant's fastest configuration among those whose footprint fits the budget."""
    best: dict[str, TrialRecord] = {}
    for record in cell.ranked(mode):
        footprint = footprint_mb(record)
        if footprint is not None and footprint <= budget_mb:
            best.setdefault(record.variant, record)
    return best


def writes_inputs(record: TrialRecord) -> bool:
    """Whether the record's variant writes its results into its inputs (declared in place)."""
    variants = variants_of(record.op)
    return record.variant in variants and bool(variants[record.variant].inplace)


def cell_winner(
    cell: CellResult, mode: str = "cold", calls: int | None = None, allow_inplace: bool = True,
    memory_budget_mb: float | None = None,
) -> Winner | None:
    """The winner of a cell, or None when nothing passed (or fits). Without `allow_inplace`,
    the winner among variants that leave their inputs alone (what a caller that keeps them
    needs). `memory_budget_mb` applies to the cells of passes with a backward (their records
    carry memory), not to forward cells."""
    ranking = Ranking.of(cell, mode, calls, memory_budget_mb)
    budget = ranking.budget_mb
    if budget is not None:
        best = _fitting_per_variant(cell, mode, budget)
    else:
        best = cell.best_per_variant(mode)
    if not allow_inplace:
        best = {name: r for name, r in best.items() if not writes_inputs(r)}
    if not best:
        return None
    if calls is not None:
        return _winner_by_calls(cell, best, ranking, calls)
    verdict = cell.verdicts.get(mode)
    if verdict is not None:
        decided = _decided_winner(cell, best, verdict, budget)
        if decided is not None:
            return Winner(decided, cell.record_of(verdict.runner_up) if verdict.runner_up
                          else None, verdict, ranking)
    ordered = list(best.values())
    return Winner(ordered[0], ordered[1] if len(ordered) > 1 else None, None, ranking)


def _winner_by_calls(cell: CellResult, best: dict[str, TrialRecord], ranking: Ranking,
                     calls: int) -> Winner:
    """The cheapest of `best` over first use + `calls` x latency (--calls)."""
    first_use = first_use_by_variant(cell)
    ordered = sorted(best.values(), key=lambda r: _cost(r, ranking.mode, calls, first_use))
    return Winner(ordered[0], ordered[1] if len(ordered) > 1 else None, None, ranking)


def _decided_winner(cell: CellResult, best: dict[str, TrialRecord], verdict: Verdict,
                    budget: float | None) -> TrialRecord | None:
    """The verdict's winner when it passed and is still among `best` (and, under a memory
    budget, is the very configuration that fits); else None."""
    winner = cell.record_of(verdict.winner)
    if winner is None or not winner.passed or winner.variant not in best:
        return None
    if budget is not None and best[winner.variant].config_label() != winner.config_label():
        return None
    return winner


def break_even(
    winner: TrialRecord, other: TrialRecord | None, cell: CellResult, mode: str
) -> float | None:
    """Calls after which the winner's first use has paid for itself against `other`."""
    if other is None or other.variant == winner.variant:
        return None
    costs = first_use_by_variant(cell)
    a_latency, b_latency = winner.latency_ms(mode), other.latency_ms(mode)
    if a_latency is None or b_latency is None:
        return None
    return break_even_calls(
        costs.get(winner.variant, 0.0), a_latency, costs.get(other.variant, 0.0), b_latency
    )

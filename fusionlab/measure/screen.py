"""The screen: a brief warm timing of a configuration before its full measurement, so only
configurations that can still win a cell are measured in full (as successive halving keeps the
promising half; here the bar is set by what the cell has measured in full so far).

A configuration is screened out when its brief warm median exceeds `bar_ms`: (1 + MARGIN) x the
best warm median measured in full in its cell (twice that when other processes disturbed the
brief timing). A brief timing above the bar is taken once more and the faster of the two kept:
noise only ever slows a timing, and one slow burst must not rule out what could win. MARGIN is
wide on purpose: contenders for the
verdict lie within 10% of the fastest, a brief timing on a shared machine is noisier than a full
one, and the cold ranking can differ from the warm one. The runner screens a configuration only
when its variant already has a full measurement in the cell, so every variant keeps one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fusionlab.measure.disturbance import Disturbance
from fusionlab.measure.timing import TimingSettings
from fusionlab.records import Timing, TrialRecord

MARGIN = 0.5
DISTURBED_FACTOR = 2.0

BRIEF = TimingSettings(warmup_s=0.01, budget_s=0.03, min_samples=5, max_samples=30,
                       checked_calls=1)


@dataclass(frozen=True)
class Screen:
    """The bar a configuration's brief warm median must stay under to be measured in full."""

    bar_ms: float
    timing: TimingSettings = field(default_factory=lambda: BRIEF)

    def rules_out(self, time_brief: Callable[[], tuple[Timing, Disturbance | None]],
                  record: TrialRecord) -> bool:
        """True (and the record says why, with its brief timing) when it cannot win.
        `time_brief` takes one brief timing and what else ran meanwhile; above the bar it is
        called once more and the faster timing kept. A brief timing that other processes
        disturbed must clear twice the bar: a disturbance only ever slows a timing."""
        brief, seen = time_brief()
        if brief.median_ms > self._bar(seen):
            again, seen_again = time_brief()
            if again.median_ms < brief.median_ms:
                brief, seen = again, seen_again
        bar = self._bar(seen)
        if brief.median_ms <= bar:
            return False
        record.timing = brief
        record.message = (
            f"screened out: brief warm median {brief.median_ms:.4g} ms is above "
            f"{bar:.4g} ms ({bar / self.bar_ms * (1 + MARGIN):g}x the best measured in full here)"
        )
        return True

    def _bar(self, seen: Disturbance | None) -> float:
        return self.bar_ms * (DISTURBED_FACTOR if seen is not None and seen.disturbed else 1)


def bar_for(best_full_warm_ms: float) -> Screen:
    return Screen((1 + MARGIN) * best_full_warm_ms)

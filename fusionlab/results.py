"""What a sweep concluded, in the result schema (schema.py): each cell's verdicts, the cell with
its records, and the winners file's rows. The runner writes these; tables, exports, the report
and the Dispatcher read them; none of them is computed here (verdict.py decides)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fusionlab.cell import Cell
from fusionlab.records import TrialRecord
from fusionlab.schema import (
    SCHEMA_VERSION,
    SchemaError,
    Stored,
    Versioned,
    parse,
    plain,
    version_of,
)


class Decision(str, Enum):
    """How sure a cell's winner is: a verdict's outcome (see verdict.py), or how a row
    was ranked without one."""

    FASTER = "faster"
    EQUIVALENT = "equivalent"
    INCONCLUSIVE = "inconclusive"
    ONLY = "only contender"
    BY_COST = "by cost"  # --calls: first use + calls x latency, no verdict
    NOT_REMEASURED = "not re-measured"  # the fastest median, no verdict
    WITHIN_BUDGET = "within memory budget"  # --memory-budget: the fastest that fits, no verdict

    def __str__(self) -> str:
        return self.value


OUTCOMES = (Decision.FASTER, Decision.EQUIVALENT, Decision.INCONCLUSIVE, Decision.ONLY)
"""The decisions a verdict can reach."""


def classify(low: float, high: float, threshold: float) -> Decision:
    """The outcome of an interval of slower / fastest: `faster` above 1 + threshold,
    `equivalent` inside [1 / (1 + threshold), 1 + threshold], else `inconclusive`."""
    if low > 1 + threshold:
        return Decision.FASTER
    if low >= 1 / (1 + threshold) and high <= 1 + threshold:
        return Decision.EQUIVALENT
    return Decision.INCONCLUSIVE


@dataclass
class Verdict(Versioned):
    """The decided winner of a cell from its re-measurement, with the interval and the reason.

    runner_up: the contender the decision is about: an equivalent one the preference passed
    over, else the inconclusive one closest to the fastest, else the second fastest. `ratio` /
    `ci_low` / `ci_high`: the runner-up over the fastest (the winner over the fastest when the
    runner-up is the fastest). `versus_winner`: the op's baseline and built-in (their best
    configurations, measured in the same rounds) over the winner, [ratio, low, high]. Names are
    config labels (`variant(k=v)`). `contenders` and
    `rounds`: which labels were re-measured and how the rounds went (set by the runner).
    """

    noun = "verdict"

    ranking: list[str]
    latency_ms: dict[str, float]
    winner: str
    runner_up: str | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    decision: Decision
    equivalent_group: list[str]
    reason: str
    confidence: float
    threshold: float
    resamples: int
    seed: int
    versus_fastest: dict[str, list[float]] = field(default_factory=dict)
    versus_winner: dict[str, list[float]] = field(default_factory=dict)
    contenders: list[str] = field(default_factory=list)
    rounds: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.decision not in OUTCOMES:
            choices = ", ".join(repr(d.value) for d in OUTCOMES)
            raise SchemaError(f"field 'decision' should be one of {choices}, found "
                              f"{self.decision.value!r}")

    @classmethod
    def migrate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Version 1: a verdict stored before outcomes had names (`tie`, `tie_group`) gets its
        decision classified from its interval."""
        if "tie_group" in data:
            data.setdefault("equivalent_group", data["tie_group"])
        low, high = data.get("ci_low"), data.get("ci_high")
        threshold = data.get("threshold", 0.03)
        if "decision" not in data and low is None:
            data["decision"] = Decision.ONLY
        elif "decision" not in data and all(
            isinstance(v, (int, float)) for v in (low, high, threshold)
        ):
            data["decision"] = classify(low, high, threshold)  # else parse names the field
        return data


@dataclass
class CellResult:
    """Every record measured in one cell, and the re-measured verdicts by rank mode."""

    cell: Cell
    records: list[TrialRecord] = field(default_factory=list)
    rejected: int = 0
    verdicts: dict[str, Verdict] = field(default_factory=dict)

    def ranked(self, mode: str = "cold") -> list[TrialRecord]:
        """Passing records, fastest first by the rank mode's median; failures never appear."""
        passing = [r for r in self.records if r.passed]
        return sorted(passing, key=lambda r: r.latency_ms(mode) or float("inf"))

    def best_per_variant(self, mode: str = "cold") -> dict[str, TrialRecord]:
        best: dict[str, TrialRecord] = {}
        for record in self.ranked(mode):
            best.setdefault(record.variant, record)
        return best

    def failures(self) -> list[TrialRecord]:
        return [r for r in self.records if not r.passed]

    def only(self, variants: list[str] | None) -> CellResult:
        """This cell as one sweep asked for it: the records of its variants (None: all) and
        the verdicts among them alone."""
        if variants is None:
            return self
        records = [r for r in self.records if r.variant in variants]
        labels = {r.config_label() for r in records}
        verdicts = {
            mode: verdict
            for mode, verdict in self.verdicts.items()
            if set(verdict.contenders) <= labels
        }
        return CellResult(self.cell, records, self.rejected, verdicts)

    def record_of(self, label: str) -> TrialRecord | None:
        return next((r for r in self.records if r.config_label() == label), None)


@dataclass
class OutOfPlace(Stored):
    """The best variant of a cell that leaves its inputs alone."""

    variant: str
    params: dict[str, Any]


@dataclass
class WinnerRow(Stored):
    """One cell's winner as the tables, the exports and the Dispatcher read it: numbers stay
    numbers (None where unknown; report/tables.py formats them for display).

    variant / label: the winner's name, and how tables show it (`x (in place)` for a variant
    that writes into its inputs); None when nothing passed. ratio / ci_low / ci_high: the
    runner-up over the winner, from the interleaved rounds (None when not re-measured).
    speedup_vs_baseline / _builtin: that variant's best over the winner, measured in the same
    rounds, with its `_ci` [low, high] (None when not measured side by side; 1.0 when it is the
    winner). `disturbed`: the keys of the figures that come from a window other processes
    disturbed (after re-measuring it), shown marked; `noisy`: those whose timing's IQR is above
    report/tables.py's NOISY_IQR, shown with fewer digits. failed of measured
    configurations, `failures` by status.
    """

    device: str
    shape: str
    dtype: str
    failed: int
    measured: int
    threads: int = 0
    pass_name: str = "forward"  # the pass timed (forward, backward or forward+backward)
    ranked_by: str = ""
    toolchain: dict[str, str] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    variant: str | None = None
    label: str | None = None
    params: dict[str, Any] | None = None
    inplace: bool = False
    out_of_place: OutOfPlace | None = None
    median_ms: float | None = None
    iqr_pct: float | None = None
    warm_ms: float | None = None
    cold_ms: float | None = None
    speedup_vs_baseline: float | None = None
    speedup_vs_baseline_ci: list[float] | None = None
    speedup_vs_builtin: float | None = None
    speedup_vs_builtin_ci: list[float] | None = None
    gbps: float | None = None
    pct_fresh_copy: float | None = None
    pct_inplace_copy: float | None = None
    runner_up: str | None = None
    runner_up_label: str | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    decision: Decision | None = None
    reason: str = ""
    first_use_ms: float | None = None
    break_even_vs_baseline: float | None = None
    break_even_vs_builtin: float | None = None
    ops_per_call: float | None = None
    idle_pct: float | None = None
    mb_per_call: float | None = None
    saved_mb: float | None = None  # a backward pass: tensors saved between forward and backward
    forward_peak_mb: float | None = None  # a backward pass: the most allocated in the forward
    backward_peak_mb: float | None = None  # ... and in the backward
    disturbed: list[str] = field(default_factory=list)  # column keys measured while busy
    noisy: list[str] = field(default_factory=list)  # column keys whose IQR is above NOISY_IQR


@dataclass
class WinnersFile:
    """`fusionlab export OP --format json`: the rows and what they were ranked by, `"version":
    SCHEMA_VERSION` in its meta. A version 1 file (display text for the ratio, the params and
    the failures) is migrated; a newer one refused."""

    op: str
    rows: list[WinnerRow]
    ranked_by: str = ""
    storage: str = ""

    def to_dict(self) -> dict[str, Any]:
        meta = {"op": self.op, "ranked_by": self.ranked_by, "storage": self.storage}
        return {"meta": {**meta, "version": SCHEMA_VERSION}, "rows": plain(self.rows)}

    @classmethod
    def from_dict(cls, data: Any) -> WinnersFile:
        if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
            raise SchemaError("a winners file should be an object with `meta` and `rows`")
        meta = data["meta"]
        version = version_of(meta, "winners file", "version")
        flat = {**{k: v for k, v in meta.items() if k != "version"}, "rows": data.get("rows")}
        try:
            if version < SCHEMA_VERSION:
                rows = flat["rows"]
                if isinstance(rows, list):
                    flat["rows"] = [_row_v1(row, f"rows[{i}]") for i, row in enumerate(rows)]
                return parse(cls, flat, strict=False)
            return parse(cls, flat)
        except SchemaError as error:
            raise SchemaError(f"winners file: {error}") from None


_NUMBER_V1 = r"\d+\.\d+|inf|nan"  # as `:.2f` wrote them
_RATIO_V1 = re.compile(
    rf"(?P<ratio>{_NUMBER_V1})x(?: \[(?P<low>{_NUMBER_V1}), (?P<high>{_NUMBER_V1})\]"
    r"| \(not re-measured\))"
)
_FAILED_V1 = re.compile(r"(?P<failed>\d+)/(?P<measured>\d+)(?: \((?P<detail>[\w ,]+)\))?")


def _row_v1(row: Any, where: str) -> Any:
    """A version 1 row (`fastest` the label, `params` and `params_values`, the ratio and the
    failures as text) as a version 2 row."""
    if not isinstance(row, dict):
        return row
    row = dict(row)
    label, values = row.pop("fastest", None), row.pop("params_values", None)
    passed = values is not None
    row.update(label=label if passed else None, params=values,
               variant=row.get("variant", label) if passed else None,
               runner_up_label=row.get("runner_up"))
    ratio = row.pop("ratio", None)
    if ratio is not None:
        match = _RATIO_V1.fullmatch(str(ratio))
        if match is None:
            raise SchemaError(f"field '{where}.ratio' should read like '2.40x [2.30, 2.68]', "
                              f"found {ratio!r}")
        row.update({k: float(v) for k, v in (("ratio", match["ratio"]), ("ci_low", match["low"]),
                                             ("ci_high", match["high"])) if v is not None})
    failed = _FAILED_V1.fullmatch(str(row.get("failed")))
    if failed is None:
        raise SchemaError(f"field '{where}.failed' should read like '1/8 (1 crashed)', "
                          f"found {row.get('failed')!r}")
    failures = re.findall(r"(\d+) (\w+)", failed["detail"] or "")
    row.update(failed=int(failed["failed"]), measured=int(failed["measured"]),
               failures={status: int(count) for count, status in failures})
    return row

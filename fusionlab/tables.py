"""The best-config table: one row per (device, shape, dtype), built from records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionlab.records import TrialRecord
from fusionlab.registry import get_op
from fusionlab.results import CellResult
from fusionlab.shapes import format_shape
from fusionlab.stats import Summary, overlaps


def _num(digits: int) -> Callable[[Any], str]:
    return lambda value: f"{value:.{digits}f}"


def _sig(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    render: Callable[[Any], str] = str


COLUMNS = (
    Column("device", "device"),
    Column("shape", "shape"),
    Column("dtype", "dtype"),
    Column("fastest", "fastest"),
    Column("params", "params"),
    Column("median_ms", "median ms", _sig),
    Column("iqr_pct", "IQR %", _num(1)),
    Column("speedup_vs_baseline", "vs naive", lambda v: f"{v:.2f}x"),
    Column("speedup_vs_default", "vs builtin", lambda v: f"{v:.2f}x"),
    Column("gbps", "GB/s", _sig),
    Column("runner_up", "runner-up"),
    Column("margin_pct", "margin %", _num(1)),
    Column("tie", "tie", lambda v: "tie" if v else "no"),
    Column("ops_per_call", "ops/call", _sig),
    Column("idle_pct", "idle %", _num(1)),
    Column("mb_per_call", "MB/call", _sig),
    Column("first_use_ms", "setup+first call ms", _sig),
    Column("failed", "failed"),
)


def _summary(record: TrialRecord) -> Summary:
    timing = record.timing
    assert timing is not None
    return Summary(
        timing.median_ms, timing.q1_ms, timing.q3_ms, timing.min_ms, len(timing.samples_ms)
    )


def _params(record: TrialRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(record.params.items())) or "-"


def best_row(cell: CellResult) -> dict[str, Any]:
    """The typed row for one cell; numbers stay numbers (None where unknown)."""
    spec = get_op(cell.op)
    ranked = cell.ranked()
    per_variant = cell.best_per_variant()
    failed = len(cell.failures())
    row: dict[str, Any] = {column.key: None for column in COLUMNS}
    row.update(
        device=cell.device_name,
        shape=format_shape(cell.shape),
        dtype=cell.dtype,
        fastest="none passed",
        failed=f"{failed}/{len(cell.records)}",
    )
    if not ranked:
        return row
    best = ranked[0]
    timing = best.timing
    assert timing is not None
    row.update(
        fastest=best.variant,
        params=_params(best),
        median_ms=timing.median_ms,
        iqr_pct=100 * timing.relative_iqr,
        gbps=best.gbps,
        first_use_ms=(best.setup_ms or 0.0) + timing.first_call_ms,
    )
    for key, name in (
        ("speedup_vs_baseline", spec.baseline),
        ("speedup_vs_default", spec.default_variant),
    ):
        other = per_variant.get(name)
        if other is not None and other.timing is not None:
            row[key] = other.timing.median_ms / timing.median_ms
    others = [r for r in per_variant.values() if r.variant != best.variant]
    if others:
        runner = others[0]
        assert runner.timing is not None
        row.update(
            runner_up=runner.variant,
            margin_pct=100 * (runner.timing.median_ms / timing.median_ms - 1),
            tie=overlaps(_summary(best), _summary(runner)),
        )
    if best.fusion is not None:
        row.update(
            ops_per_call=best.fusion.device_ops,
            mb_per_call=best.fusion.memory_bytes / 1e6,
            idle_pct=None if best.fusion.idle_share is None else 100 * best.fusion.idle_share,
        )
    return row


def best_rows(cells: list[CellResult]) -> list[dict[str, Any]]:
    return [best_row(cell) for cell in cells]


def display_row(row: dict[str, Any]) -> dict[str, str]:
    """The row as the text every format shows ('-' for unknown)."""
    return {c.header: "-" if row[c.key] is None else c.render(row[c.key]) for c in COLUMNS}


def display_rows(rows: list[dict[str, Any]], with_device: bool = True) -> list[dict[str, str]]:
    shown = [display_row(row) for row in rows]
    if not with_device:
        for row in shown:
            row.pop("device")
    return shown

"""The best-config table: one row per cell, built from records and the cell's verdict."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionlab.registry import get_op
from fusionlab.report.fit import fit_table, pick_columns
from fusionlab.report.winners import break_even, cell_winner, first_use_by_variant, writes_inputs
from fusionlab.search.results_store import CellResult
from fusionlab.shapes import format_shape


def _num(digits: int) -> Callable[[Any], str]:
    return lambda value: f"{value:.{digits}f}"


def _sig(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _calls(value: float) -> str:
    return "never" if value == float("inf") else f"{value:.3g}"


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    render: Callable[[Any], str] = str


def columns(baseline: str = "baseline", builtin: str = "builtin") -> tuple[Column, ...]:
    """The table's columns; the speedup headers name the op's own baseline and built-in."""
    return (
        Column("device", "device"),
        Column("shape", "shape"),
        Column("dtype", "dtype"),
        Column("fastest", "fastest"),
        Column("params", "params"),
        Column("median_ms", "median ms", _sig),
        Column("iqr_pct", "IQR %", _num(1)),
        Column("warm_ms", "warm ms", _sig),
        Column("cold_ms", "cold ms", _sig),
        Column("speedup_vs_baseline", f"vs {baseline}", lambda v: f"{v:.2f}x"),
        Column("speedup_vs_builtin", f"vs {builtin}", lambda v: f"{v:.2f}x"),
        Column("gbps", "GB/s", _sig),
        Column("pct_fresh_copy", "% fresh copy", _num(0)),
        Column("pct_inplace_copy", "% in-place copy", _num(0)),
        Column("runner_up", "runner-up"),
        Column("ratio", "runner-up/winner [95% CI]"),
        Column("decision", "decision"),
        Column("first_use_ms", "first use ms", _sig),
        Column("break_even_vs_baseline", f"break-even calls vs {baseline}", _calls),
        Column("break_even_vs_builtin", f"break-even calls vs {builtin}", _calls),
        Column("ops_per_call", "ops/call", _sig),
        Column("idle_pct", "idle %", _num(1)),
        Column("mb_per_call", "MB/call", _sig),
        Column("failed", "failed"),
    )


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "-"


def _failed(cell: CellResult) -> str:
    failures = cell.failures()
    counts = Counter(r.status.value for r in failures)
    detail = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return f"{len(failures)}/{len(cell.records)}" + (f" ({detail})" if detail else "")


def best_row(cell: CellResult, mode: str = "cold", calls: int | None = None) -> dict[str, Any]:
    """The typed row for one cell; numbers stay numbers (None where unknown)."""
    spec = get_op(cell.cell.op)
    row: dict[str, Any] = {column.key: None for column in columns()}
    row.update(
        device=cell.cell.device_name,
        threads=cell.cell.threads,
        shape=format_shape(cell.cell.shape),
        dtype=cell.cell.dtype,
        fastest="none passed",
        failed=_failed(cell),
        ranked_by=mode if calls is None else f"{mode} + {calls} calls x latency",
        toolchain=cell.cell.toolchain,
    )
    winner = cell_winner(cell, mode, calls)
    if winner is None:
        return row
    best = winner.record
    timing = best.timing_for(mode)
    assert timing is not None
    per_variant = cell.best_per_variant(mode)
    row.update(
        fastest=best.variant,
        variant=best.variant,
        params=_params(best.params),
        params_values=dict(best.params),
        median_ms=timing.median_ms,
        iqr_pct=100 * timing.relative_iqr,
        warm_ms=best.latency_ms("warm"),
        cold_ms=best.cold.median_ms if best.cold is not None else None,
        gbps=best.gbps(mode),
        first_use_ms=first_use_by_variant(cell).get(best.variant),
    )
    share = best.limit_share(mode)
    if share is not None:
        row.update(pct_fresh_copy=100 * share["fresh"], pct_inplace_copy=100 * share["inplace"])
    for key, name in (("baseline", spec.baseline), ("builtin", spec.builtin)):
        other = per_variant.get(name)
        other_ms = other.latency_ms(mode) if other is not None else None
        if other_ms:
            row[f"speedup_vs_{key}"] = other_ms / timing.median_ms
        row[f"break_even_vs_{key}"] = break_even(best, other, cell, mode)
    if winner.runner_up is not None:
        row["runner_up"] = winner.runner_up.variant
    row["inplace"] = writes_inputs(best)
    if row["inplace"]:
        row["fastest"] = f"{best.variant} (in place)"
        keeps_inputs = cell_winner(cell, mode, calls, allow_inplace=False)
        if keeps_inputs is not None:
            row["out_of_place"] = {
                "variant": keeps_inputs.record.variant,
                "params": dict(keeps_inputs.record.params),
            }
    verdict = winner.verdict
    if verdict is not None and verdict.get("runner_up"):
        row["ratio"] = (
            f"{verdict['ratio']:.2f}x [{verdict['ci_low']:.2f}, {verdict['ci_high']:.2f}]"
        )
        row["reason"] = verdict["reason"]
    elif winner.runner_up is not None:
        runner_ms = winner.runner_up.latency_ms(mode)
        if runner_ms:
            row["ratio"] = f"{runner_ms / timing.median_ms:.2f}x (not re-measured)"
    if winner.runner_up is not None or winner.verdict is not None:
        row["decision"] = winner.decision
    if best.fusion is not None:
        row.update(
            ops_per_call=best.fusion.device_ops,
            mb_per_call=best.fusion.memory_bytes / 1e6,
            idle_pct=None if best.fusion.idle_share is None else 100 * best.fusion.idle_share,
        )
    return row


def best_rows(
    cells: list[CellResult], mode: str = "cold", calls: int | None = None
) -> list[dict[str, Any]]:
    return [best_row(cell, mode, calls) for cell in cells]


def display_rows(
    rows: list[dict[str, Any]], op: str, with_device: bool = True
) -> list[dict[str, str]]:
    """The rows as the text every format shows ('-' for unknown)."""
    spec = get_op(op)
    shown = []
    for row in rows:
        text = {
            c.header: "-" if row.get(c.key) is None else c.render(row[c.key])
            for c in columns(spec.baseline, spec.builtin)
        }
        if not with_device:
            text.pop("device")
        shown.append(text)
    return shown


def _decision_with_interval(row: dict[str, Any]) -> str | None:
    """`decision ratio [low, high]`: how sure, in one cell of a narrow table."""
    if row.get("decision") is None:
        return None
    ratio = row.get("ratio")
    return f"{row['decision']} {ratio}" if ratio else str(row["decision"])


def _winner(row: dict[str, Any]) -> str | None:
    params = row.get("params")
    if params is None or params == "-":
        return row.get("fastest")
    return f"{row['fastest']} ({params})"


# The terminal's own columns: the winner with its parameters, and the decision with its interval.
_COMPACT = {
    "winner": ("winner", _winner),
    "decided": ("decision [95% CI]", _decision_with_interval),
}
_COVERS = {"winner": ("fastest", "params"), "decided": ("decision", "ratio")}
# What a narrow terminal shows, most important first; columns drop from the end to fit.
TERMINAL_PRIORITY = (
    "shape",
    "dtype",
    "winner",
    "decided",
    "speedup_vs_baseline",
    "speedup_vs_builtin",
    "median_ms",
    "pct_fresh_copy",
    "pct_inplace_copy",
    "failed",
)


def column_keys() -> list[str]:
    """Every name `--columns` accepts."""
    return [c.key for c in columns()] + list(_COMPACT)


def terminal_table(
    rows: list[dict[str, Any]],
    op: str,
    width: int,
    wide: bool = False,
    chosen: str | None = None,
    with_device: bool = False,
    fmt: str = "simple",
) -> tuple[str, list[str]]:
    """The best-config table for a terminal `width` columns wide: the essentials that fit, every
    column with `wide`, or the `chosen` ones (`--columns a,b,c`). Returns the text and the column
    keys left out."""
    spec = get_op(op)
    full = columns(spec.baseline, spec.builtin)
    headers = {c.key: c.header for c in full} | {k: h for k, (h, _) in _COMPACT.items()}
    shown = display_rows(rows, op)
    for row, text in zip(rows, shown, strict=True):
        for header, value_of in _COMPACT.values():
            value = value_of(row)
            text[header] = "-" if value is None else value
    if chosen is not None:
        keys = pick_columns(chosen, column_keys())
        return fit_table(shown, [headers[k] for k in keys], 10**6, fmt=fmt)[0], []
    if wide:
        keys = [c.key for c in full if with_device or c.key != "device"]
        return fit_table(shown, [headers[k] for k in keys], 10**6, fmt=fmt)[0], []
    keys = (["device"] if with_device else []) + list(TERMINAL_PRIORITY)
    text, left_out = fit_table(shown, [headers[k] for k in keys], width, [headers["winner"]], fmt)
    shown_keys = {k for k in keys if headers[k] not in left_out}
    shown_keys |= {covered for k in shown_keys for covered in _COVERS.get(k, ())}
    rest = [c.key for c in full if c.key not in shown_keys and c.key != "device"]
    return text, rest

"""The best-config table: one row per cell, built from records and the cell's verdict."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionlab.records import TrialRecord
from fusionlab.registry import get_op
from fusionlab.report.fit import fit_table, pick_columns
from fusionlab.results import CellResult, OutOfPlace, Verdict, WinnerRow
from fusionlab.shapes import format_shape
from fusionlab.verdict import implausible
from fusionlab.winners import (
    Ranking,
    Winner,
    break_even,
    cell_winner,
    first_use_by_variant,
    writes_inputs,
)


def _num(digits: int) -> Callable[[float], str]:
    return lambda value: f"{value:.{digits}f}"


def _sig(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _calls(value: float) -> str:
    return "never" if value == float("inf") else f"{value:.3g}"


def _speedup(key: str) -> Callable[[WinnerRow], str | None]:
    """`ratio [low, high]` over the winner, measured side by side; 1.00x for the winner itself."""

    def text(row: WinnerRow) -> str | None:
        value, interval = getattr(row, key), getattr(row, f"{key}_ci")
        if value is None:
            return None
        return f"{value:.2f}x" if interval is None else (
            f"{value:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]")

    return text


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "-"


def _ratio(row: WinnerRow) -> str | None:
    """`runner-up/winner [low, high]` from the interleaved rounds; None when not re-measured
    (a ratio of two unpaired search medians is never shown)."""
    if row.ratio is None or row.ci_low is None or row.ci_high is None:
        return None
    return f"{row.ratio:.2f}x [{row.ci_low:.2f}, {row.ci_high:.2f}]"


def _failed(row: WinnerRow) -> str:
    detail = ", ".join(f"{n} {status}" for status, n in sorted(row.failures.items()))
    return f"{row.failed}/{row.measured}" + (f" ({detail})" if detail else "")


BUSY_MARK = "!"
"""Follows a figure measured while other processes used more than a quarter of the cores (after
the re-measurements a disturbed window gets): slower and noisier than on a quiet machine."""

SEARCH_FIGURES = ("median_ms", "iqr_pct", "warm_ms", "cold_ms", "gbps", "pct_fresh_copy",
                  "pct_inplace_copy")
"""The figures a row takes from its winner's search trial."""
ROUND_FIGURES = ("ratio", "speedup_vs_baseline", "speedup_vs_builtin", "decision")
"""The figures a row takes from the cell's interleaved rounds."""


def disturbed_figures(best: TrialRecord, verdict: Verdict | None) -> list[str]:
    """The keys of the row's figures that come from a disturbed window: the winner's trial
    (still disturbed after its re-measurements), the rounds (fewer quiet rounds than a verdict
    needs, so disturbed ones were used)."""
    busy = list(SEARCH_FIGURES) if best.disturbance and best.disturbance.disturbed else []
    if verdict is not None and (verdict.rounds.get("from_disturbed") or implausible(verdict)):
        busy += ROUND_FIGURES
    return busy


NOISY_IQR = 0.10
"""A figure whose timing's IQR is above this share of its median (torch.utils.benchmark's
warning threshold) is shown with ROUGH_DIGITS significant digits after a `~`."""
ROUGH_DIGITS = 2


def rough(value: float) -> str:
    """`~` and the value to ROUGH_DIGITS significant digits (never in exponent notation)."""
    if value == 0 or not math.isfinite(value):
        return f"~{value:g}"
    decimals = ROUGH_DIGITS - 1 - math.floor(math.log10(abs(value)))
    return f"~{round(value, decimals):.{max(decimals, 0)}f}"


def noisy_figures(best: TrialRecord, mode: str) -> list[str]:
    """The keys of the row's figures from a timing whose IQR is above NOISY_IQR."""
    ranked = best.timing_for(mode)
    noisy = []
    if ranked is not None and ranked.relative_iqr > NOISY_IQR:
        noisy += ["median_ms", "gbps", "pct_fresh_copy", "pct_inplace_copy"]
    for key, timing in (("warm_ms", best.timing), ("cold_ms", best.cold)):
        if timing is not None and timing.relative_iqr > NOISY_IQR:
            noisy.append(key)
    return noisy


@dataclass(frozen=True)
class Column:
    """A column: its `--columns` key, its header, and its text for a row (None: unknown)."""

    key: str
    header: str
    text: Callable[[WinnerRow], str | None]


def _field(name: str, render: Callable[[Any], str] = str) -> Callable[[WinnerRow], str | None]:
    def text(row: WinnerRow) -> str | None:
        value = getattr(row, name)
        return None if value is None else render(value)

    return text


def columns(baseline: str = "baseline", builtin: str = "builtin") -> tuple[Column, ...]:
    """The table's columns; the speedup headers name the op's own baseline and built-in."""
    return (
        Column("device", "device", _field("device")),
        Column("shape", "shape", _field("shape")),
        Column("dtype", "dtype", _field("dtype")),
        Column("pass", "pass", _field("pass_name")),
        Column("fastest", "fastest", lambda row: row.label or "none passed"),
        Column("params", "params", _field("params", _params)),
        Column("median_ms", "median ms", _field("median_ms", _sig)),
        Column("iqr_pct", "IQR %", _field("iqr_pct", _num(1))),
        Column("warm_ms", "warm ms", _field("warm_ms", _sig)),
        Column("cold_ms", "cold ms", _field("cold_ms", _sig)),
        Column("speedup_vs_baseline", f"vs {baseline}", _speedup("speedup_vs_baseline")),
        Column("speedup_vs_builtin", f"vs {builtin}", _speedup("speedup_vs_builtin")),
        Column("gbps", "GB/s", _field("gbps", _sig)),
        Column("pct_fresh_copy", "% fresh copy", _field("pct_fresh_copy", _num(0))),
        Column("pct_inplace_copy", "% in-place copy", _field("pct_inplace_copy", _num(0))),
        Column("runner_up", "runner-up", _field("runner_up_label")),
        Column("ratio", "runner-up/winner [95% CI]", _ratio),
        Column("decision", "decision", _field("decision")),
        Column("first_use_ms", "first use ms", _field("first_use_ms", _sig)),
        Column("break_even_vs_baseline", f"break-even calls vs {baseline}",
               _field("break_even_vs_baseline", _calls)),
        Column("break_even_vs_builtin", f"break-even calls vs {builtin}",
               _field("break_even_vs_builtin", _calls)),
        Column("ops_per_call", "ops/call", _field("ops_per_call", _sig)),
        Column("idle_pct", "idle %", _field("idle_pct", _num(1))),
        Column("mb_per_call", "MB/call", _field("mb_per_call", _sig)),
        Column("saved_mb", "saved MB", _field("saved_mb", _sig)),
        Column("forward_peak_mb", "fwd peak MB", _field("forward_peak_mb", _sig)),
        Column("backward_peak_mb", "bwd peak MB", _field("backward_peak_mb", _sig)),
        Column("failed", "failed", _failed),
    )


def _label(variant: str, inplace: bool) -> str:
    return f"{variant} (in place)" if inplace else variant


def best_row(cell: CellResult, mode: str = "cold", calls: int | None = None,
             memory_budget_mb: float | None = None) -> WinnerRow:
    """The typed row for one cell; numbers stay numbers (None where unknown)."""
    failures = cell.failures()
    ranking = Ranking.of(cell, mode, calls, memory_budget_mb)
    row = WinnerRow(
        device=cell.cell.device_name,
        threads=cell.cell.threads,
        pass_name=cell.cell.pass_name,
        shape=format_shape(cell.cell.shape),
        dtype=cell.cell.dtype,
        failed=len(failures),
        measured=len(cell.records),
        failures=dict(Counter(r.status.value for r in failures)),
        ranked_by=ranking.label(),
        toolchain=dict(cell.cell.toolchain),
    )
    winner = cell_winner(cell, mode, calls, memory_budget_mb=memory_budget_mb)
    if winner is None:
        if cell.ranked(mode) and ranking.budget_mb is not None:
            row.label = f"none within {memory_budget_mb:g} MB"
        return row
    best = winner.record
    _latency_figures(row, best, cell, mode)
    _memory_figures(row, best)
    row.disturbed = disturbed_figures(best, winner.verdict)
    row.noisy = noisy_figures(best, mode)
    _speedups(row, winner, cell, mode)
    if winner.runner_up is not None:
        row.runner_up = winner.runner_up.variant
        row.runner_up_label = _label(row.runner_up, writes_inputs(winner.runner_up))
    if row.inplace:
        keeps_inputs = cell_winner(cell, mode, calls, allow_inplace=False,
                                   memory_budget_mb=memory_budget_mb)
        if keeps_inputs is not None:
            row.out_of_place = OutOfPlace(
                keeps_inputs.record.variant, dict(keeps_inputs.record.params)
            )
    verdict = winner.verdict
    if verdict is not None and verdict.runner_up:
        row.ratio, row.ci_low, row.ci_high = verdict.ratio, verdict.ci_low, verdict.ci_high
        row.reason = verdict.reason
    if winner.runner_up is not None or winner.verdict is not None or memory_budget_mb is not None:
        row.decision = winner.decision  # a budget's winner says so, even as the only one that fits
    _fusion_figures(row, best)
    return row


def _latency_figures(row: WinnerRow, best: TrialRecord, cell: CellResult, mode: str) -> None:
    """The winner's names, latencies, bandwidth and first use."""
    timing = best.timing_for(mode)
    assert timing is not None
    row.variant, row.params, row.inplace = best.variant, dict(best.params), writes_inputs(best)
    row.label = _label(best.variant, row.inplace)
    row.median_ms, row.iqr_pct = timing.median_ms, 100 * timing.relative_iqr
    row.warm_ms = best.latency_ms("warm")
    row.cold_ms = best.cold.median_ms if best.cold is not None else None
    row.gbps = best.gbps(mode)
    row.first_use_ms = first_use_by_variant(cell).get(best.variant)
    share = best.limit_share(mode)
    if share is not None:
        row.pct_fresh_copy, row.pct_inplace_copy = 100 * share["fresh"], 100 * share["inplace"]


def _memory_figures(row: WinnerRow, best: TrialRecord) -> None:
    """What a pass with a backward held (none for the forward)."""
    if best.memory is not None:
        row.saved_mb = best.memory.saved_bytes / 1e6
        row.forward_peak_mb = best.memory.forward_peak_bytes / 1e6
        row.backward_peak_mb = best.memory.backward_peak_bytes / 1e6


def _speedups(row: WinnerRow, winner: Winner, cell: CellResult, mode: str) -> None:
    """The winner over the op's baseline and built-in: 1.0 when it is one of them, else the
    paired ratio of the rounds where both were measured; and the break-even call counts."""
    best, verdict = winner.record, winner.verdict
    spec = get_op(cell.cell.op)
    per_variant = cell.best_per_variant(mode)
    paired = verdict.versus_winner if verdict is not None and (
        verdict.winner == best.config_label()) else {}
    for key, name in (("baseline", spec.baseline), ("builtin", spec.builtin)):
        other = per_variant.get(name)
        if other is not None and other.config_label() == best.config_label():
            setattr(row, f"speedup_vs_{key}", 1.0)
        elif other is not None and other.config_label() in paired:
            ratio, low, high = paired[other.config_label()]
            setattr(row, f"speedup_vs_{key}", ratio)
            setattr(row, f"speedup_vs_{key}_ci", [low, high])
        setattr(row, f"break_even_vs_{key}", break_even(best, other, cell, mode))


def _fusion_figures(row: WinnerRow, best: TrialRecord) -> None:
    """Device ops, memory traffic and idle share per call, where profiled."""
    if best.fusion is not None:
        row.ops_per_call = best.fusion.device_ops
        row.mb_per_call = best.fusion.memory_bytes / 1e6
        if best.fusion.idle_share is not None:
            row.idle_pct = 100 * best.fusion.idle_share


def best_rows(
    cells: list[CellResult], mode: str = "cold", calls: int | None = None,
    memory_budget_mb: float | None = None,
) -> list[WinnerRow]:
    return [best_row(cell, mode, calls, memory_budget_mb) for cell in cells]


def texts_by_key(
    rows: list[WinnerRow], op: str, with_device: bool = True, by_header: bool = False
) -> list[dict[str, str]]:
    """The rows as the text every format shows ('-' for unknown), by column key (by its
    header with `by_header`)."""
    spec = get_op(op)
    shown = []
    for row in rows:
        text = {c.header if by_header else c.key: _marked(_figure(c, row), c.key in row.disturbed)
                for c in columns(spec.baseline, spec.builtin)
                if with_device or c.key != "device"}
        shown.append(text)
    return shown


def display_rows(
    rows: list[WinnerRow], op: str, with_device: bool = True
) -> list[dict[str, str]]:
    """The rows as the text every format shows ('-' for unknown), by column header."""
    return texts_by_key(rows, op, with_device, by_header=True)


def _figure(column: Column, row: WinnerRow) -> str | None:
    """The column's text for the row, with the digits its noise supports."""
    value = getattr(row, column.key, None)
    if column.key in row.noisy and isinstance(value, float):
        return rough(value)
    return column.text(row)


def _marked(text: str | None, busy: bool) -> str:
    """The cell's text ('-' for unknown), BUSY_MARK after a figure from a disturbed window."""
    if text is None:
        return "-"
    return text + BUSY_MARK if busy else text


def _decision_with_interval(row: WinnerRow) -> str | None:
    """`decision ratio [low, high]`: how sure, in one cell of a narrow table."""
    if row.decision is None:
        return None
    ratio = _ratio(row)
    return f"{row.decision} {ratio}" if ratio else str(row.decision)


def _winner(row: WinnerRow) -> str:
    if not row.params:
        return row.label or "none passed"
    return f"{row.label} ({_params(row.params)})"


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


def check_columns(chosen: str | None) -> None:
    """Refuse an unknown `--columns` name before anything is measured or read."""
    if chosen is not None:
        pick_columns(chosen, column_keys())


def _headers(op: str) -> dict[str, str]:
    """Each `--columns` key's header for this op."""
    spec = get_op(op)
    full = columns(spec.baseline, spec.builtin)
    return {c.key: c.header for c in full} | {k: h for k, (h, _) in _COMPACT.items()}


def _with_compact(rows: list[WinnerRow], op: str) -> list[dict[str, str]]:
    """The display rows with the terminal's compact columns (winner, decision [95% CI]) too."""
    shown = display_rows(rows, op)
    for row, text in zip(rows, shown, strict=True):
        for key, (header, value_of) in _COMPACT.items():
            covered = _COVERS[key][-1]  # the winner's params, the decision's ratio
            text[header] = _marked(value_of(row), covered in row.disturbed)
    return shown


def chosen_rows(rows: list[WinnerRow], op: str, chosen: str) -> tuple[list[str], list[dict]]:
    """Exactly the `--columns a,b,c` of each row, in that order: the keys and, per row, the
    header -> text of those columns (an unknown name is a UserError)."""
    keys = pick_columns(chosen, column_keys())
    headers = _headers(op)
    picked = [headers[key] for key in keys]
    return keys, [{header: text[header] for header in picked} for text in _with_compact(rows, op)]


def terminal_table(
    rows: list[WinnerRow],
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
    headers = _headers(op)
    shown = _with_compact(rows, op)
    if chosen is not None:
        keys = pick_columns(chosen, column_keys())
        return fit_table(shown, [headers[k] for k in keys], 10**6, fmt=fmt)[0], []
    if wide:
        keys = [c.key for c in full if with_device or c.key != "device"]
        return fit_table(shown, [headers[k] for k in keys], 10**6, fmt=fmt)[0], []
    keys = (["device"] if with_device else []) + list(TERMINAL_PRIORITY)
    if any(row.pass_name != "forward" for row in rows):
        keys.insert(keys.index("dtype") + 1, "pass")  # a backward sweep says so in every row
        keys.insert(keys.index("median_ms") + 1, "saved_mb")
    text, left_out = fit_table(shown, [headers[k] for k in keys], width, [headers["winner"]], fmt)
    shown_keys = {k for k in keys if headers[k] not in left_out}
    shown_keys |= {covered for k in shown_keys for covered in _COVERS.get(k, ())}
    rest = [c.key for c in full if c.key not in shown_keys and c.key != "device"]
    return text, rest

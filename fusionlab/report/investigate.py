"""What `fusionlab compare` and `fusionlab profile` print: each variant's key_averages table, the
summary of how it ran as units of work, one verdict line per variant, and the traces written.
The profiling itself is in investigation.py."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusionlab.measure.profiling import ProfilerSettings
from fusionlab.plan import SweepPlan
from fusionlab.records import TrialRecord
from fusionlab.report import fit
from fusionlab.shapes import format_shape


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_rows(records: list[TrialRecord], baseline: str) -> list[dict[str, str]]:
    """One row per variant: device time, wall latency, ops, largest op, gaps, host, memory."""
    base = next((r for r in records if r.variant == baseline and r.passed), None)
    rows = []
    for record in records:
        fusion, timing = record.fusion, record.timing
        if not record.passed or fusion is None or timing is None:
            rows.append({"variant": record.config_label(), "status": record.status.value})
            continue
        idle = (
            "-"
            if fusion.idle_us is None
            else f"{fusion.idle_us:.1f} ({100 * (fusion.idle_share or 0):.0f}%)"
        )
        speedup = (
            "-"
            if base is None or base.timing is None
            else f"{base.timing.median_ms / timing.median_ms:.2f}x"
        )
        rows.append(
            {
                "variant": record.config_label(),
                "status": record.status.value,
                "device us/call": _us(fusion.device_time_us),
                "wall ms/call": f"{timing.median_ms:.4g} ±{100 * timing.relative_iqr:.0f}%",
                f"{fusion.unit}s/call": f"{fusion.device_ops:g}",
                "largest op (share)": f"{fusion.top_op} ({100 * fusion.top_op_share:.0f}%)",
                "idle us (of span)": idle,
                "host us": _us(fusion.host_us),
                "MB/call": f"{fusion.memory_bytes / 1e6:.3g}",
                f"vs {baseline}": speedup,
            }
        )
    return rows


def verdict(record: TrialRecord) -> str:
    """One plain-language line on how the variant ran as units of work."""
    fusion = record.fusion
    if not record.passed or fusion is None:
        return f"{record.variant}: {record.status.value} - {record.message[:200]}"
    ops = round(fusion.device_ops)
    parts = [f"{record.variant}: {ops} {fusion.unit}{'s' if ops != 1 else ''} per call"]
    repeated = [f"{name} x{count:g}" for name, count in fusion.op_counts.items() if count > 1]
    if repeated:
        parts.append(f"({', '.join(repeated)})")
    if ops > 1 and fusion.idle_share is not None:
        parts.append(f"with {100 * fusion.idle_share:.0f}% of its span idle between them")
    if ops == 1:
        parts.append(f"({fusion.top_op})")
    if fusion.nested_ops and fusion.counts_operator_records:
        parts.append(
            f"- {fusion.nested_ops:g} more ATen ops nested inside {'it' if ops == 1 else 'them'}"
        )
    return " ".join(parts)


def render(records: list[TrialRecord], plan: SweepPlan, trace_dir: str | None,
           wide: bool) -> None:
    """Print the investigation of `records`, fitted to the terminal unless `wide`."""
    device = plan.device
    width = 10**6 if wide else fit.terminal_width()
    (shape,), (dtype,) = plan.shapes, plan.dtypes

    def show(text: str) -> None:
        print(fit.wrap(text, width))

    show(
        f"{plan.op} {format_shape(shape)} {dtype} on {device.type}: {plan.device_label}, "
        f"torch {torch.__version__}"
    )
    show(
        f"profiler: activities {[a.name for a in device.profiler_activities()]}, "
        f"{ProfilerSettings().describe()}"
    )
    cropped = _print_profiles(records, width, show)
    print()
    _print_summary(records, plan.spec.baseline, width, cropped, show)
    print()
    for record in records:
        show(verdict(record))
    traces = [r.trace_file for r in records if r.trace_file]
    if traces:
        print("\ntraces (open in https://ui.perfetto.dev or chrome://tracing):")
        for path in traces:
            print(f"  {path}")
    if trace_dir and device.profile_viewer:
        show(f"{device.type} device profile: {trace_dir} (open with {device.profile_viewer})")


def _print_profiles(records: list[TrialRecord], width: int, show: Callable[[str], None]) -> bool:
    """Each record's key_averages table (or why it has none); True when one was cropped."""
    cropped = False
    for record in records:
        print(f"\n== {record.config_label()} ==")
        if record.profile_table:
            table, cut = fit.crop_fixed_table(record.profile_table, width)
            cropped = cropped or cut
            print(table)
        else:
            show(f"{record.status.value}: {record.message}")
    return cropped


def _print_summary(records: list[TrialRecord], baseline: str, width: int, cropped: bool,
                   show: Callable[[str], None]) -> None:
    """The summary table, where its units of work come from, notes, and what was left out."""
    rows = summary_rows(records, baseline)
    order = list(dict.fromkeys(key for row in rows for key in row))
    text, left_out = fit.fit_table(rows, sorted(order, key=_importance), width, ["variant"])
    print(text)
    sources = {r.fusion.source for r in records if r.fusion}
    for source in sorted(sources):
        show(f"units of work - {source}")
    for note in sorted({r.fusion.note for r in records if r.fusion and r.fusion.note}):
        show(f"note: {note}")
    if cropped or left_out:
        show(
            "columns left out to fit the terminal: "
            + ", ".join((["key_averages' right-hand columns"] if cropped else []) + left_out)
            + " (--wide shows them)"
        )


def _importance(column: str) -> int:
    """Summary columns most important first: the variant, how it ran, its speed, its fusion."""
    order = (
        lambda c: c == "variant",
        lambda c: c == "status",
        lambda c: c == "wall ms/call",
        lambda c: c.startswith("vs "),
        lambda c: c.endswith("ops/call"),
        lambda c: c == "MB/call",
        lambda c: c.startswith("idle"),
        lambda c: c == "device us/call",
    )
    return next((i for i, matches in enumerate(order) if matches(column)), len(order))

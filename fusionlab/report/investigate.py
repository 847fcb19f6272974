"""`fusionlab compare` and `fusionlab profile`: the seed's profiling investigation as a command.

Variants and parameters are chosen and validated by the same planning path as `sweep`, and run
through the same trial; the numbers are read off the profiler's events (see
measure/profiling.py), never parsed from printed tables."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from fusionlab import plan as planning
from fusionlab.errors import UserError
from fusionlab.measure.profiling import ProfilerSettings
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import TrialRecord
from fusionlab.registry import get_op, get_variant
from fusionlab.report import fit
from fusionlab.shapes import format_shape, parse_dtype, parse_shape


def prepare_folder(path: str, what: str) -> str:
    """Create a folder for output files; one line to the user when it cannot be written."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {what} {path!r} ({error.strerror}); pick another") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"{what} {path!r} is not writable; pick another")
    return str(folder.resolve())


def _prepare_trace_dir(path: str | None) -> str | None:
    return None if path is None else prepare_folder(path, "trace dir")


def _run(
    configs: list[tuple[str, dict[str, Any]]],
    args: argparse.Namespace,
    plan: planning.SweepPlan,
    trace_dir: str | None,
) -> list[TrialRecord]:
    cells = plan.cells()
    if not cells:
        raise UserError(f"no variant of {args.op} runs {plan.dtypes[0]} on {plan.device.type}")
    (cell,) = cells  # one shape, one dtype
    records = []
    with TrialWorker(args.plugin, threads=plan.threads, allocator=plan.allocator) as worker:
        for name, params in configs:
            task = TrialTask(
                cell=cell,
                variant=name,
                params=params,
                seed=args.seed,
                profile_table_rows=args.rows,
                trace_dir=trace_dir,
            )
            records.append(TrialRecord.from_dict(worker.run(task, plan.timeout_s)))
    return records


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


def _report(
    records: list[TrialRecord],
    args: argparse.Namespace,
    plan: planning.SweepPlan,
    trace_dir: str | None,
) -> None:
    spec, device = get_op(args.op), plan.device
    width = 10**6 if args.wide else fit.terminal_width()
    (shape,), (dtype,) = plan.shapes, plan.dtypes

    def show(text: str) -> None:
        print(fit.wrap(text, width))

    show(
        f"{args.op} {format_shape(shape)} {dtype} on {device.type}: {plan.device_label}, "
        f"torch {torch.__version__}"
    )
    show(
        f"profiler: activities {[a.name for a in device.profiler_activities()]}, "
        f"{ProfilerSettings().describe()}"
    )
    cropped = False
    for record in records:
        print(f"\n== {record.config_label()} ==")
        if record.profile_table:
            table, cut = fit.crop_fixed_table(record.profile_table, width)
            cropped = cropped or cut
            print(table)
        else:
            show(f"{record.status.value}: {record.message}")
    print()
    rows = summary_rows(records, spec.baseline)
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


def _plan(args: argparse.Namespace, variants: str | None) -> planning.SweepPlan:
    """The same planning path as sweep, for one shape and one dtype."""
    shape, dtype = format_shape(parse_shape(args.shape)), parse_dtype(args.dtype)
    return planning.make_plan(
        args.op,
        shape,
        dtype,
        args.device,
        variants,
        args.plugin,
        timeout_s=args.timeout,
        seed=args.seed,
        threads=args.threads,
        allocator=args.allocator,
    )


def compare_command(args: argparse.Namespace) -> int:
    plan = _plan(args, args.variants)
    trace_dir = _prepare_trace_dir(args.trace_dir)
    (shape,), (dtype,) = plan.shapes, plan.dtypes
    configs = [
        (v.name, planning.first_config(v, shape, plan.device.type))
        for v in plan.cell_variants(dtype)
    ]
    _report(_run(configs, args, plan, trace_dir), args, plan, trace_dir)
    return 0


def profile_command(args: argparse.Namespace) -> int:
    plan = _plan(args, args.variant)
    trace_dir = _prepare_trace_dir(args.trace_dir)
    (shape,) = plan.shapes
    variant = get_variant(args.op, args.variant)
    params = planning.parse_params(variant, args.param, shape, plan.device.type)
    records = _run([(variant.name, params)], args, plan, trace_dir)
    _report(records, args, plan, trace_dir)
    record = records[0]
    if record.fusion is not None:
        print("\nops per call:")
        for name, count in record.fusion.op_counts.items():
            print(f"  {count:g} x {name}")
    if record.timing is not None:
        timing = record.timing
        print(
            f"setup {record.setup_ms or 0:.4g} ms and first call "
            f"{record.first_call_ms or 0:.4g} ms "
            "(build and compile live there); "
            f"{len(timing.samples_ms)} samples of {timing.calls_per_sample} calls: median "
            f"{timing.median_ms:.4g} ms, IQR {timing.q1_ms:.4g}-{timing.q3_ms:.4g} ms, "
            f"CV {100 * timing.cv:.1f}%"
        )
    return 0 if record.passed else 1

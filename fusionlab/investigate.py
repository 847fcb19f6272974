"""`fusionlab compare` and `fusionlab profile`: the seed's profiling investigation as a command.

Every variant runs through the same measurement path and one profiler configuration; the numbers
are read off the profiler's events (see profiling.py), never parsed from printed tables."""

from __future__ import annotations

import argparse
import ast
import os
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from fusionlab import api
from fusionlab.devices import Device, resolve_device
from fusionlab.errors import UserError
from fusionlab.profiling import ProfilerSettings
from fusionlab.records import Fusion, TrialRecord
from fusionlab.registry import Variant, get_op, get_variant, variants_of
from fusionlab.shapes import format_shape, parse_dtype, parse_shape
from fusionlab.trial import TrialTask
from fusionlab.worker import TrialWorker


def _prepare_trace_dir(path: str | None) -> str | None:
    if path is None:
        return None
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(
            f"cannot create trace dir {path!r} ({error.strerror}); pick another"
        ) from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"trace dir {path!r} is not writable; pick another")
    return str(folder.resolve())


def default_params(variant: Variant, shape: tuple[int, ...], device_type: str) -> dict[str, Any]:
    """The first configuration of the variant that can run at this shape."""
    for params in variant.configurations():
        if variant.rejects(shape, params, device_type) is None:
            return params
    raise UserError(
        f"variant {variant.name!r} has no configuration that runs at {format_shape(shape)}"
    )


def _parse_params(
    variant: Variant, pairs: list[str], shape: tuple[int, ...], device_type: str
) -> dict[str, Any]:
    params = default_params(variant, shape, device_type) if variant.tunables else {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in variant.tunables:
            raise UserError(
                f"--param {pair!r}: use NAME=VALUE with NAME among "
                f"{', '.join(variant.tunables) or '(no tunables)'}"
            )
        try:
            params[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            params[name] = text
    reason = variant.rejects(shape, params, device_type)
    if reason:
        raise UserError(f"params {params} cannot run: {reason}")
    return params


def _run(
    configs: list[tuple[str, dict[str, Any]]],
    args: argparse.Namespace,
    device: Device,
    shape: tuple[int, ...],
    dtype: str,
    trace_dir: str | None,
) -> list[TrialRecord]:
    records = []
    device_name = device.hardware_name()
    with TrialWorker(args.plugin) as worker:
        for name, params in configs:
            task = TrialTask(
                op=args.op,
                variant=name,
                params=params,
                device=device.type,
                device_name=device_name,
                shape=shape,
                dtype=dtype,
                seed=args.seed,
                profile_table_rows=args.rows,
                trace_dir=trace_dir,
            )
            records.append(worker.run(task, args.timeout))
    return records


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_rows(records: list[TrialRecord], baseline: str) -> list[dict[str, str]]:
    """One row per variant: device time, wall latency, launches, largest op, gaps, host, memory."""
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
                "ops/call": f"{fusion.device_ops:g}",
                "largest op (share)": f"{fusion.top_op} ({100 * fusion.top_op_share:.0f}%)",
                "idle us (of span)": idle,
                "host us": _us(fusion.host_us),
                "MB/call": f"{fusion.memory_bytes / 1e6:.3g}",
                "vs naive": speedup,
            }
        )
    return rows


def _ops_are_host_records(fusion: Fusion) -> bool:
    return fusion.source.startswith("CPU")


def verdict(record: TrialRecord) -> str:
    """One plain-language line on how the variant ran as device work."""
    fusion = record.fusion
    if not record.passed or fusion is None:
        return f"{record.variant}: {record.status.value} - {record.message[:200]}"
    ops = round(fusion.device_ops)
    parts = [f"{record.variant}: {ops} device op{'s' if ops != 1 else ''} per call"]
    repeated = [f"{name} x{count:g}" for name, count in fusion.op_counts.items() if count > 1]
    if repeated:
        parts.append(f"({', '.join(repeated)})")
    if ops > 1 and fusion.idle_share is not None:
        parts.append(f"with {100 * fusion.idle_share:.0f}% of its span idle between them")
    if ops == 1:
        parts.append(f"({fusion.top_op})")
    if fusion.nested_ops and _ops_are_host_records(fusion):
        parts.append(
            f"- {fusion.nested_ops:g} more ATen ops nested inside {'it' if ops == 1 else 'them'}"
        )
    return " ".join(parts)


def _report(
    records: list[TrialRecord],
    args: argparse.Namespace,
    device: Device,
    shape: tuple[int, ...],
    dtype: str,
) -> None:
    spec = get_op(args.op)
    print(
        f"{args.op} {format_shape(shape)} {dtype} on {device.type}: {device.hardware_name()}, "
        f"torch {torch.__version__}"
    )
    print(
        f"profiler: activities {[a.name for a in device.profiler_activities()]}, "
        f"{ProfilerSettings().describe()}"
    )
    for record in records:
        print(f"\n== {record.config_label()} ==")
        print(record.profile_table or f"{record.status.value}: {record.message}")
    print()
    print(
        tabulate(
            summary_rows(records, spec.baseline),
            headers="keys",
            tablefmt="simple",
            disable_numparse=True,
        )
    )
    sources = {r.fusion.source for r in records if r.fusion}
    for source in sorted(sources):
        print(f"units of work - {source}")
    for note in sorted({r.fusion.note for r in records if r.fusion and r.fusion.note}):
        print(f"note: {note}")
    print()
    for record in records:
        print(verdict(record))
    traces = [r.trace_file for r in records if r.trace_file]
    if traces:
        print("\ntraces (open in https://ui.perfetto.dev or chrome://tracing):")
        for path in traces:
            print(f"  {path}")
    if device.type == "neuron" and args.trace_dir:
        print(f"Neuron device profile: {args.trace_dir} (open with neuron-explorer view -d ...)")


def _cell(args: argparse.Namespace) -> tuple[Device, tuple[int, ...], str, str | None]:
    api.load_user_variants(args.plugin)
    spec = get_op(args.op)
    shape = parse_shape(args.shape)
    problem = spec.check_shape(shape)
    if problem:
        raise UserError(f"shape {args.shape}: {problem}")
    dtype = parse_dtype(args.dtype)
    device = resolve_device(args.device)
    return device, shape, dtype, _prepare_trace_dir(args.trace_dir)


def compare_command(args: argparse.Namespace) -> int:
    device, shape, dtype, trace_dir = _cell(args)
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        variants = [get_variant(args.op, n) for n in names]
    else:
        variants = [
            v for v in variants_of(args.op).values() if v.unavailable_reason(device.type) is None
        ]
    for variant in variants:
        reason = variant.unavailable_reason(device.type)
        if reason:
            raise UserError(f"variant {variant.name!r} cannot run on {device.type} here: {reason}")
    configs = [
        (v.name, default_params(v, shape, device.type)) for v in variants if dtype in v.dtypes
    ]
    _report(_run(configs, args, device, shape, dtype, trace_dir), args, device, shape, dtype)
    return 0


def profile_command(args: argparse.Namespace) -> int:
    device, shape, dtype, trace_dir = _cell(args)
    variant = get_variant(args.op, args.variant)
    reason = variant.unavailable_reason(device.type)
    if reason:
        raise UserError(f"variant {variant.name!r} cannot run on {device.type} here: {reason}")
    params = _parse_params(variant, args.param, shape, device.type)
    records = _run([(variant.name, params)], args, device, shape, dtype, trace_dir)
    _report(records, args, device, shape, dtype)
    record = records[0]
    if record.fusion is not None:
        print("\nops per call:")
        for name, count in record.fusion.op_counts.items():
            print(f"  {count:g} x {name}")
    if record.timing is not None:
        timing = record.timing
        print(
            f"setup {record.setup_ms or 0:.4g} ms and first call {timing.first_call_ms:.4g} ms "
            "(build and compile live there); "
            f"{len(timing.samples_ms)} samples of {timing.calls_per_sample} calls: median "
            f"{timing.median_ms:.4g} ms, IQR {timing.q1_ms:.4g}-{timing.q3_ms:.4g} ms, "
            f"CV {100 * timing.cv:.1f}%"
        )
    return 0 if record.passed else 1

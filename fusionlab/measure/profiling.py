"""The profiler pass and the fusion accounting read off its events.

On CUDA and Neuron the device's own kernel events are the units of work. On CPU, the outermost
operator records of each call stand in for device events: that is where control returns to the
dispatcher (and to Python) between ops, so the gaps between them are the seed's dispatch gaps.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import profile, record_function, schedule

from fusionlab.devices import Device
from fusionlab.records import Fusion

CALL_MARKER = "fusionlab/call"
COMPILED_REGION = "Torch-Compiled Region"
# Ops that only describe, view or allocate memory; they move no data.
METADATA_OPS = frozenset(
    "aten::" + name
    for name in [
        "empty",
        "empty_strided",
        "empty_like",
        "view",
        "reshape",
        "_reshape_alias",
        "as_strided",
        "expand",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "detach",
        "alias",
        "resize_",
        "result_type",
        "lift_fresh",
        "_unsafe_view",
        "slice",
        "select",
        "contiguous",
        "to",
        "type_as",
        "size",
        "stride",
        "numel",
        "dim",
        "is_nonzero",
        "resolve_conj",
        "resolve_neg",
        "lift",
    ]
)


@dataclass(frozen=True)
class ProfilerSettings:
    """One profiler configuration, identical for every variant, and printed with results."""

    wait: int = 1
    warmup: int = 2
    active: int = 5
    record_shapes: bool = True
    profile_memory: bool = True

    def __post_init__(self) -> None:
        if self.wait < 1 or self.active < 1:
            # Seen with torch 2.13: a schedule that starts warming up at step 0 records nothing.
            raise ValueError("the profiler schedule needs wait >= 1 and active >= 1")

    def describe(self) -> str:
        return (
            f"schedule(wait={self.wait}, warmup={self.warmup}, active={self.active}), "
            f"record_shapes={self.record_shapes}, profile_memory={self.profile_memory}, "
            "one call per step, device synchronised after each call"
        )


def profile_calls(
    call: Callable[[], object],
    device: Device,
    settings: ProfilerSettings,
    extra: dict[str, Any] | None = None,
) -> profile:
    """Run the call under torch.profiler with the shared schedule; return the profiler.

    `extra` is the device's own profiler arguments (Device.profiler_extra)."""
    steps = settings.wait + settings.warmup + settings.active
    with profile(
        activities=device.profiler_activities(),
        schedule=schedule(wait=settings.wait, warmup=settings.warmup, active=settings.active),
        record_shapes=settings.record_shapes,
        profile_memory=settings.profile_memory,
        **(extra or {}),
    ) as prof:
        for _ in range(steps):
            with record_function(CALL_MARKER):
                call()
            device.synchronize()
            prof.step()
    return prof


def _is_cpu_unit(event: FunctionEvent) -> bool:
    if event.name.startswith(COMPILED_REGION):
        return True
    return "::" in event.name and event.name not in METADATA_OPS


def _outermost_units(event: FunctionEvent) -> Iterable[FunctionEvent]:
    for child in event.cpu_children:
        if _is_cpu_unit(child):
            yield child
        else:
            yield from _outermost_units(child)


def operator_input_elements(prof: profile) -> float:
    """Median over calls of the tensor elements the outermost operators of a call took as
    inputs (from record_shapes); a compiled region, whose generated code the profiler does not
    see op by op, counts as unbounded."""
    per_call = []
    for marker in (e for e in prof.events() if e.name == CALL_MARKER):
        total = 0.0
        for unit in _outermost_units(marker):
            if unit.name.startswith(COMPILED_REGION):
                total = math.inf
                break
            total += sum(math.prod(shape) for shape in unit.input_shapes or [] if shape)
        per_call.append(total)
    return float(statistics.median(per_call)) if per_call else 0.0


def _count_nested(event: FunctionEvent) -> int:
    return sum(
        (child.name.startswith("aten::") and child.name not in METADATA_OPS) + _count_nested(child)
        for child in event.cpu_children
    )


@dataclass(frozen=True)
class _Interval:
    name: str
    start: float
    end: float


def _busy(intervals: list[_Interval]) -> float:
    """Length of the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for item in sorted(intervals, key=lambda i: i.start):
        if item.end > reach:
            total += item.end - max(item.start, reach)
            reach = item.end
    return total


@dataclass
class _CallStats:
    ops: int
    busy: float
    span: float
    host: float
    memory: float
    nested: int
    durations: dict[str, float]
    counts: dict[str, int]


def _call_stats(units: list[_Interval], host: float, memory: float, nested: int) -> _CallStats:
    durations: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for unit in units:
        durations[unit.name] += unit.end - unit.start
        counts[unit.name] += 1
    span = max(u.end for u in units) - min(u.start for u in units) if units else 0.0
    return _CallStats(len(units), _busy(units), span, host, memory, nested, durations, counts)


def _memory_records(prof: profile, device: Device) -> list[tuple[float, int]]:
    """(relative start in us, bytes) of every allocation on the device that does the work."""
    results = prof.profiler.kineto_results if prof.profiler else None
    if results is None:
        return []
    origin = results.trace_start_ns()
    wanted = device.event_device_types or (torch.autograd.DeviceType.CPU,)
    return [
        ((event.start_ns() - origin) / 1e3, event.nbytes())
        for event in results.events()
        if event.name() == "[memory]" and event.device_type() in wanted and event.nbytes() > 0
    ]


def fusion_accounting(prof: profile, device: Device) -> Fusion:
    """Device ops, busy time, idle gaps, host time and memory per call, as medians over calls."""
    return account_events(list(prof.events()), _memory_records(prof, device), device)


def account_events(
    events: list[FunctionEvent], allocations: list[tuple[float, int]], device: Device
) -> Fusion:
    """The fusion accounting of a profiler's event list (CPU call markers with their operator
    trees, and the device's own events) and its allocations, (start us, bytes)."""
    markers = sorted(
        (
            e
            for e in events
            if e.name == CALL_MARKER and e.device_type == torch.autograd.DeviceType.CPU
        ),
        key=lambda e: e.time_range.start,
    )
    if not markers:
        raise RuntimeError("the profiler recorded no calls")
    # Zero-length device events are what a backend hands back when it keeps the real trace to
    # itself (TorchNeuron may): they are no measurement.
    device_events = [
        e
        for e in events
        if e.device_type in device.event_device_types and e.time_range.end > e.time_range.start
    ]
    use_device_events = bool(device.event_device_types) and bool(device_events)
    calls = []
    for index, marker in enumerate(markers):
        start = marker.time_range.start
        stop = markers[index + 1].time_range.start if index + 1 < len(markers) else float("inf")
        outer = list(_outermost_units(marker))
        cpu_units = [_Interval(u.name, u.time_range.start, u.time_range.end) for u in outer]
        nested = sum(_count_nested(unit) for unit in outer)
        memory = float(sum(size for at, size in allocations if start <= at < stop))
        host = marker.time_range.end - start
        if use_device_events:
            units = [
                _Interval(e.name, e.time_range.start, e.time_range.end)
                for e in device_events
                if start <= e.time_range.start < stop
            ]
        else:
            units = cpu_units
            if not device.event_device_types:
                host -= _busy(units)
        calls.append(_call_stats(units, host, memory, nested))
    return _summarise_calls(calls, device, use_device_events)


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def _summarise_calls(calls: list[_CallStats], device: Device, use_device_events: bool) -> Fusion:
    durations, counts = _op_totals(calls)
    total = sum(durations.values())
    top = max(durations, key=durations.__getitem__) if durations else ""
    host_only = bool(device.event_device_types) and not use_device_events
    return Fusion(
        source=_source(device, use_device_events),
        device_ops=_median(c.ops for c in calls),
        **_device_time(calls, known=not host_only),
        top_op=top,
        top_op_share=durations[top] / total if total > 0 else 0.0,
        host_us=_median(c.host for c in calls),
        memory_bytes=_median(c.memory for c in calls),
        nested_ops=_median(c.nested for c in calls),
        op_counts=dict(sorted(counts.items(), key=lambda kv: -durations[kv[0]])),
        note=(f"the profiler returned no {device.type} device events, so device time and idle "
              "gaps are unknown; ops counted on the host") if host_only else "",
        unit="host op" if host_only else "device op",
    )


def _op_totals(calls: list[_CallStats]) -> tuple[dict[str, float], dict[str, float]]:
    """Each op's duration summed over the calls, and its count per call (a mean)."""
    durations: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    for call in calls:
        for name, value in call.durations.items():
            durations[name] += value
        for name, value in call.counts.items():
            counts[name] += value / len(calls)
    return durations, counts


def _source(device: Device, use_device_events: bool) -> str:
    """Where the device ops were counted."""
    if not device.event_device_types:
        return f"{device.type}: outermost operator records are the device ops"
    return f"{device.type}: device events" if use_device_events else f"{device.type}: host ops"


def _device_time(calls: list[_CallStats], known: bool) -> dict[str, float | None]:
    """Device busy time, span, idle time and idle share per call (medians); None when the
    profiler returned no device events for a device that has them."""
    if not known:
        return {"device_time_us": None, "span_us": None, "idle_us": None, "idle_share": None}
    busy = _median(c.busy for c in calls)
    span = _median(c.span for c in calls)
    return {"device_time_us": busy, "span_us": span, "idle_us": span - busy,
            "idle_share": (span - busy) / span if span > 0 else None}


def key_averages_table(prof: profile, device: Device, row_limit: int = 12) -> str:
    """torch's key_averages() table, sorted by device time (self CPU time on CPU)."""
    sort_by = "self_device_time_total" if device.event_device_types else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)


def export_trace(prof: profile, trace_dir: str, stem: str) -> str:
    """Write a Chrome-trace JSON (opens in Perfetto) and return its path."""
    path = Path(trace_dir) / f"{stem}.json"
    prof.export_chrome_trace(str(path))
    return str(path)

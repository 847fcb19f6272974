"""Neuron profiling: torch.profiler arguments, device time per call from the Neuron profile, and
the first-compile cost (cache locations, a cold-compile timeout).

Sources (awsdocs-neuron; aws-neuron/aws-neuron-sdk at commit a3247f5b, "Neuron Release 2.32.0",
and the v2.33 pages where noted):
- tools/neuron-explorer/how-to-profile-workload.rst ("PyTorch"), and v2.33
  tools/neuron-explorer/how-to-profile-pytorch: ``torch.profiler.profile(activities=[CPU,
  PrivateUse1], experimental_config=NeuronConfig(modes=[...], profile_output_dir=...),
  on_trace_ready=NeuronProfiler(cfg).export_trace)`` from ``torch_neuronx.profiling``; the
  PrivateUse1 activity is "controlled by NeuronConfig"; ``modes`` defaults to [DEVICE, RUNTIME];
  ProfileMode.DEVICE "reserves approximately 5 GB of HBM on Trn2"; RUNTIME writes
  ``trace_info.pb`` / ``ntrace.pb``, DEVICE writes ``.neff`` / ``.ntff`` (binary).
- Reading device time: the RUNTIME (system) profile holds one ``nc_exec_running`` event per NEFF
  execution on a NeuronCore, a hardware event whose timestamps the runtime maps to the CPU clock
  (archive/profiler/neuron-profiler-2-0-beta-user-guide.rst, "Adjusting Hardware Timestamps";
  tools/neuron-explorer/glossary.rst). ``neuron-explorer view -d DIR --output-format json``
  writes ``system_profile.json`` whose trace events carry ``name``, ``timestamp`` and ``duration``
  in ns (tools/neuron-explorer/get-started.rst "Export to JSON"; the 2.0 guide names the list
  ``trace_events``, exports seen in public scripts name it ``trace_event``: both are read). The
  default Parquet output has the same events in ``SystemProfileEvents`` (``name``, ``start_ts``,
  ``end_ts``, ``duration_ns``, ``trace_event_source`` = ``neuron_hw`` for device events,
  ``nc_idx``; tools/neuron-explorer/profile-schema-reference.rst, schema 7.4.0), read when
  pyarrow is importable. With LNC=2 both physical cores report the execution; overlapping
  intervals on one logical core are merged into one call.
- Compile caches: NKI's kernel cache is ``NKI_COMPILE_CACHE_URL``, default
  ``/var/tmp/nki-intermediate-cache-uid<uid>`` (compiler/error-codes/EVRF067-ENKI006, latest);
  TorchNeuron's NEFF cache is ``TORCH_NEURONX_NEFF_CACHE_DIR`` (tools/neuron-explorer/
  environment-variables.rst; "system default" there, ``/tmp/neff_cache`` in the profiling guide's
  example); the torch-xla era persistent cache is ``NEURON_COMPILE_CACHE_URL`` or
  ``--cache_dir`` in ``NEURON_CC_FLAGS``, default ``/var/tmp/neuron-compile-cache``
  (about-neuron/arch/neuron-features/neuron-caching.rst).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXEC_EVENT = "nc_exec_running"

# No compile time for one small kernel is documented; vLLM Neuron's compilation-cache design note
# says neuronx-cc compilation of a graph "sometimes exceed[s] several minutes for large graphs".
# A norm kernel is a small graph, so ten minutes covers a cold compile with margin; trials that
# hit a warm cache should keep the ordinary per-trial timeout.
COLD_COMPILE_TIMEOUT_S = 600.0


class ProfilerKwargs(dict):
    """torch.profiler.profile keyword arguments, with the Neuron output directory they write to."""

    output_dir: str


def profiler_kwargs(trace_dir: str | None, instruction_trace: bool = False) -> ProfilerKwargs:
    """Keyword arguments for torch.profiler.profile on `neuron`: NeuronConfig always, RUNTIME
    mode, DEVICE too only when `instruction_trace` (it reserves ~5 GB of HBM on Trn2)."""
    try:
        from torch.profiler import ProfilerActivity
        from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, ProfileMode
    except ImportError as exc:
        raise RuntimeError(f"Neuron profiling needs torch-neuronx with torch_neuronx.profiling "
                           f"(from AWS's Neuron repository): {exc}") from exc
    output_dir = trace_dir if trace_dir is not None else tempfile.mkdtemp(prefix="neuron-profile-")
    modes = [ProfileMode.RUNTIME]
    if instruction_trace:
        modes.insert(0, ProfileMode.DEVICE)
    config = NeuronConfig(modes=modes, profile_output_dir=output_dir)
    kwargs = ProfilerKwargs(
        activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
        experimental_config=config,
        on_trace_ready=NeuronProfiler(config).export_trace,
    )
    kwargs.output_dir = output_dir
    return kwargs


def export_command(profile_dir: str | os.PathLike[str], output_file: str | os.PathLike[str]
                   ) -> list[str]:
    """The documented neuron-explorer call that writes the system profile as JSON."""
    return ["neuron-explorer", "view", "-d", str(profile_dir), "--output-format", "json",
            "--ignore-device-profile", "--output-file", str(output_file)]


@dataclass(frozen=True)
class DeviceTime:
    """Device time per call read from a Neuron profile; None (with the reason) when unknown."""

    per_call_s: float | None
    calls: list[float] = field(default_factory=list)  # seconds, one per execution, in time order
    source: str | None = None
    reason: str | None = None


def _merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b) for a, b in merged]


def _executions(events: Iterable[dict[str, Any]]) -> list[tuple[int, int]]:
    """One interval per execution: per logical core, overlapping physical-core intervals merged."""
    per_core: dict[Any, list[tuple[int, int]]] = {}
    for e in events:
        start, length = e.get("timestamp"), e.get("duration")
        if not isinstance(start, (int, float)) or not isinstance(length, (int, float)):
            continue
        if length <= 0:
            continue  # a zero-length record is not a measurement
        core = (e.get("instance_id"), e.get("process_id"), e.get("lnc_idx", e.get("nc_idx")))
        per_core.setdefault(core, []).append((int(start), int(start + length)))
    return sorted(iv for ivs in per_core.values() for iv in _merge(ivs))


def _json_events(path: Path) -> list[dict[str, Any]] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    events = data.get("trace_events", data.get("trace_event"))
    if not isinstance(events, list):
        return None
    return [e for e in events if isinstance(e, dict) and e.get("name") == EXEC_EVENT]


def _parquet_events(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return [
        {"timestamp": row["start_ts"], "duration": row["duration_ns"],
         "instance_id": row.get("instance_id"), "process_id": row.get("process_id"),
         "nc_idx": row.get("nc_idx")}
        for row in table
        if row.get("name") == EXEC_EVENT and row.get("trace_event_source") == "neuron_hw"
    ]


def device_time_per_call(profile_dir: str | os.PathLike[str], *,
                         expected_calls: int | None = None) -> DeviceTime:
    """Median device seconds per NEFF execution in a neuron-explorer export under `profile_dir`.

    With `expected_calls`, a different number of executions makes the answer unknown (another
    op's NEFF ran too, or executions were lost), never a guess.
    """
    root = Path(profile_dir)
    if not root.is_dir():
        return DeviceTime(None, reason=f"{root} is not a directory")
    found: list[tuple[Path, list[dict[str, Any]]]] = []
    for path in sorted(root.rglob("*.json")):
        events = _json_events(path)
        if events is not None:
            found.append((path, events))
    parquet = sorted(root.rglob("SystemProfileEvents*.parquet"))
    if not found and parquet:
        try:
            found = [(p, _parquet_events(p)) for p in parquet]
        except ImportError:
            return DeviceTime(None, reason="the export is Parquet and pyarrow is not installed")
    if not found:
        binary = sorted({p.suffix for p in root.rglob("*") if p.suffix in (".ntff", ".pb")})
        hint = " ".join(export_command(root, root / "system_profile.json"))
        what = f"only binary capture files ({', '.join(binary)})" if binary else "no profile"
        return DeviceTime(None, reason=f"{what} under {root}; export it first: {hint}")
    executions = _executions(e for _, events in found for e in events)
    source = ", ".join(str(p) for p, _ in found)
    if not executions:
        return DeviceTime(None, source=source, reason=f"no timed {EXEC_EVENT} events")
    seconds = [(stop - start) / 1e9 for start, stop in executions]
    if expected_calls is not None and len(seconds) != expected_calls:
        return DeviceTime(None, seconds, source, f"expected {expected_calls} executions, "
                                                 f"found {len(seconds)}")
    return DeviceTime(statistics.median(seconds), seconds, source)



"""Fusion accounting read off real torch.profiler runs on the CPU (issue: compare/profile)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import cpu_cell
from helpers import TRIAL_TIMING as FAST

from fusionlab.devices import get_device
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm
from fusionlab.measure.profiling import ProfilerSettings, fusion_accounting, profile_calls
from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.records import Status, TrialRecord
from fusionlab.registry import get_op
from fusionlab.report.investigate import summary_rows

SHAPES = [(1, 256), (256, 4096)]


def _profiled(variant: str, shape, tmp_path: Path, params=None) -> TrialRecord:
    record = run_trial(TrialTask(cpu_cell("rmsnorm", shape), variant, params or {}, timing=FAST,
                                 profile_table_rows=10, trace_dir=str(tmp_path)))
    assert record.status is Status.PASSED, record.message
    assert record.fusion is not None
    return record


def _trace_names(path: str) -> list[str]:
    trace = json.loads(Path(path).read_text())
    return [event.get("name", "") for event in trace["traceEvents"]]


def _check_accounting(record: TrialRecord) -> None:
    fusion = record.fusion
    assert fusion is not None and fusion.device_time_us is not None
    assert fusion.span_us is not None and fusion.idle_us is not None
    assert fusion.idle_us >= 0
    assert fusion.device_time_us + fusion.idle_us == pytest.approx(fusion.span_us, abs=1e-6)
    assert 0 < fusion.top_op_share <= 1
    assert fusion.memory_bytes >= 4 * record.shape[0] * record.shape[1]  # the output at least


@pytest.mark.parametrize("shape", SHAPES)
def test_naive_runs_as_separate_ops_with_gaps(shape, tmp_path: Path) -> None:
    record = _profiled("naive", shape, tmp_path)
    fusion = record.fusion
    assert fusion.device_ops >= 5
    assert fusion.op_counts["aten::mul"] == 3
    assert "aten::mul" in record.profile_table
    _check_accounting(record)
    assert fusion.idle_us > 0  # control returns to Python between ops
    assert "aten::mul" in _trace_names(record.trace_file)


@pytest.mark.parametrize("shape", SHAPES)
def test_builtin_is_one_rms_norm_op(shape, tmp_path: Path) -> None:
    record = _profiled("builtin", shape, tmp_path)
    assert record.fusion.device_ops == 1
    assert record.fusion.op_counts == {"aten::rms_norm": 1}
    _check_accounting(record)
    assert "aten::rms_norm" in _trace_names(record.trace_file)


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_is_exactly_one_compiled_region_per_call(shape, tmp_path: Path) -> None:
    record = _profiled("compiled", shape, tmp_path, {"mode": "default", "dynamic": False})
    counts = record.fusion.op_counts
    assert len(counts) == 1
    ((name, count),) = counts.items()
    assert name.startswith("Torch-Compiled Region") and count == 1
    _check_accounting(record)
    assert any(n.startswith("Torch-Compiled Region") for n in _trace_names(record.trace_file))
    assert record.first_call_ms > record.timing.median_ms  # compile time stays apart


def test_missing_device_events_are_reported_not_printed_as_zeros(tmp_path: Path) -> None:
    """A FAKE Neuron device: no Trainium exists here, so a real CPU profile is read as if it came
    from a `neuron` run whose backend handed no device events back to torch.profiler."""
    spec = get_op("rmsnorm")
    inputs = spec.make_inputs((8, 64), torch.float32, torch.device("cpu"), 0)
    prof = profile_calls(lambda: naive_rmsnorm(*inputs), get_device("cpu"), ProfilerSettings())
    fusion = fusion_accounting(prof, get_device("neuron"))
    assert fusion.device_time_us is None and fusion.idle_us is None and fusion.span_us is None
    assert "no neuron device events" in fusion.note
    assert fusion.device_ops == 6  # launches are still counted, on the host
    record = _profiled("naive", (8, 64), tmp_path)
    record.fusion = fusion
    (row,) = summary_rows([record], "naive")
    assert row["device us/call"] == "-" and row["idle us (of span)"] == "-"

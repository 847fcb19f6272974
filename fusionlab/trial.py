"""One trial: build a variant, gate its output, time it and profile it. Runs in the worker."""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionlab.correctness import (
    IncorrectOutput,
    check_no_alias,
    check_not_mutated,
    check_output,
    snapshot,
)
from fusionlab.devices import Device
from fusionlab.profiling import (
    ProfilerSettings,
    export_trace,
    fusion_accounting,
    key_averages_table,
    profile_calls,
)
from fusionlab.records import Status, TrialRecord
from fusionlab.registry import get_op, get_variant
from fusionlab.shapes import format_shape, torch_dtype
from fusionlab.timing import TimingSettings, time_calls, timed_once


@dataclass(frozen=True)
class TrialTask:
    """Everything a worker needs to measure one configuration."""

    op: str
    variant: str
    params: dict[str, Any]
    device: str
    device_name: str
    shape: tuple[int, ...]
    dtype: str
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    profiler: ProfilerSettings = field(default_factory=ProfilerSettings)
    profile_table_rows: int = 0
    trace_dir: str | None = None

    def new_record(self, status: Status, message: str = "") -> TrialRecord:
        """A record for this task with no measurement in it yet."""
        return TrialRecord(
            op=self.op,
            variant=self.variant,
            params=dict(self.params),
            device=self.device,
            device_name=self.device_name,
            shape=list(self.shape),
            dtype=self.dtype,
            status=status,
            message=message,
            torch_version=torch.__version__,
            seed=self.seed,
        )


class _Failed(Exception):
    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    first_lines = text.splitlines()[:3]
    return " | ".join(line.strip() for line in first_lines if line.strip())[:500]


def _is_compile_error(error: BaseException) -> bool:
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.utils.cpp_extension"))


def run_trial(task: TrialTask) -> TrialRecord:
    """Measure one configuration; failures become statuses, never exceptions."""
    record = task.new_record(Status.PASSED)
    try:
        _measure(task, record)
    except _Failed as failure:
        record.status, record.message = failure.status, str(failure)
    except IncorrectOutput as error:
        record.status, record.message = Status.INCORRECT, str(error)
    except Exception as error:
        record.status = Status.RUNTIME_ERROR
        record.message = _describe(error)
        traceback.print_exc(file=sys.stderr)
    return record


def _measure(task: TrialTask, record: TrialRecord) -> None:
    spec = get_op(task.op)
    variant = get_variant(task.op, task.variant)
    device = Device(task.device)
    dtype = torch_dtype(task.dtype)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # every variant pays its own compile time in its first call
    record.bytes_moved = spec.bytes_moved(task.shape, dtype)
    tolerance = spec.tolerance(dtype)
    inputs = spec.make_inputs(task.shape, dtype, device.torch_device, task.seed)
    reference = spec.reference(inputs)
    originals = snapshot(inputs)
    like = inputs[0]
    assert isinstance(like, torch.Tensor)

    try:
        kernel, record.setup_ms = timed_once(
            lambda: variant.factory(device.type, **task.params), device.synchronize
        )
    except Exception as error:
        raise _Failed(Status.COMPILE_ERROR, f"setup failed: {_describe(error)}") from error
    try:
        out, first_ms = timed_once(lambda: kernel(*inputs), device.synchronize)
    except Exception as error:
        status = Status.COMPILE_ERROR if _is_compile_error(error) else Status.RUNTIME_ERROR
        raise _Failed(status, f"first call failed: {_describe(error)}") from error
    record.accuracy = check_output(out, reference, like, tolerance)
    check_not_mutated(inputs, originals)
    assert isinstance(out, torch.Tensor)
    check_no_alias(out, inputs)
    del out

    record.timing = time_calls(lambda: kernel(*inputs), device.synchronize, first_ms, task.timing)
    check_not_mutated(inputs, originals)
    # A second, independent input catches kernels that cache or reuse earlier results.
    fresh = spec.make_inputs(task.shape, dtype, device.torch_device, task.seed + 1)
    check_output(kernel(*fresh), spec.reference(fresh), like, tolerance)

    prof = profile_calls(lambda: kernel(*inputs), device, task.profiler, task.trace_dir)
    record.fusion = fusion_accounting(prof, device)
    if task.profile_table_rows:
        record.profile_table = key_averages_table(prof, device, task.profile_table_rows)
    if task.trace_dir is not None:
        stem = f"{task.op}_{task.variant}_{format_shape(task.shape)}_{task.dtype}"
        record.trace_file = export_trace(prof, task.trace_dir, stem)

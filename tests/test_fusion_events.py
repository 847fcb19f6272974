"""Fusion accounting on CUDA and Neuron event lists.

No GPU or Trainium exists here, so these event lists are CONSTRUCTED (real torch FunctionEvent
objects with hand-set times), shaped like what torch.profiler hands back on those devices: CPU
call markers with their operator trees, and the device's own kernel events."""

from __future__ import annotations

import itertools

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from fusionlab.devices import get_device
from fusionlab.measure.profiling import CALL_MARKER, account_events

_ids = itertools.count()


def _event(name: str, start: float, end: float, device: DeviceType = DeviceType.CPU):
    return FunctionEvent(next(_ids), name, thread=0, start_us=start, end_us=end,
                         device_type=device)


def _calls(kernels_per_call: list[list[tuple[str, float, float]]], device: DeviceType):
    """One CPU marker per call (an aten op launching inside it) plus the device's kernels."""
    events = []
    for index, kernels in enumerate(kernels_per_call):
        origin = 1000.0 * index
        marker = _event(CALL_MARKER, origin, origin + 100)
        launch = _event("aten::mul", origin + 1, origin + 5)
        marker.append_cpu_child(launch)
        launch.set_cpu_parent(marker)
        events += [marker, launch]
        events += [_event(name, origin + a, origin + b, device) for name, a, b in kernels]
    return events


UNFUSED = [("mul_kernel", 10, 20), ("mean_kernel", 30, 40), ("mul_kernel", 60, 70)]
FUSED = [("fused_rms_norm", 10, 25)]


@pytest.mark.parametrize(("device", "kind"), [("cuda", DeviceType.CUDA),
                                              ("neuron", DeviceType.PrivateUse1)])
def test_unfused_kernels_with_gaps(device: str, kind: DeviceType) -> None:
    fusion = account_events(_calls([UNFUSED] * 5, kind), [], get_device(device))
    assert fusion.device_ops == 3 and fusion.unit == "device op"
    assert fusion.device_time_us == pytest.approx(30) and fusion.span_us == pytest.approx(60)
    assert fusion.idle_us == pytest.approx(30) and fusion.idle_share == pytest.approx(0.5)
    assert fusion.top_op == "mul_kernel" and fusion.op_counts["mul_kernel"] == 2
    assert fusion.source == f"{device}: device events" and not fusion.note


@pytest.mark.parametrize(("device", "kind"), [("cuda", DeviceType.CUDA),
                                              ("neuron", DeviceType.PrivateUse1)])
def test_fused_kernel_is_one_op_without_idle(device: str, kind: DeviceType) -> None:
    allocations = [(1000.0 * i + 2, 4096) for i in range(5)]
    fusion = account_events(_calls([FUSED] * 5, kind), allocations, get_device(device))
    assert fusion.device_ops == 1 and fusion.idle_us == 0 and fusion.device_time_us == 15
    assert fusion.memory_bytes == 4096  # per call, from the allocations inside each call


def test_zero_length_device_events_are_unknown_time_counted_on_the_host() -> None:
    """TorchNeuron may hand back device events without durations: no measurement, no zeros."""
    empty = [("neff_exec", 10, 10), ("neff_exec", 30, 30)]
    fusion = account_events(_calls([empty] * 5, DeviceType.PrivateUse1), [],
                            get_device("neuron"))
    assert fusion.device_time_us is None and fusion.idle_us is None and fusion.span_us is None
    assert fusion.unit == "host op" and fusion.device_ops == 1  # the aten::mul launch
    assert "no neuron device events" in fusion.note


def test_kernels_are_assigned_to_the_call_that_launched_them() -> None:
    calls = [UNFUSED, FUSED, UNFUSED, FUSED, FUSED]
    fusion = account_events(_calls(calls, DeviceType.CUDA), [], get_device("cuda"))
    assert fusion.device_ops == 1  # the median call is fused
    assert fusion.op_counts["mul_kernel"] == pytest.approx(4 / 5)

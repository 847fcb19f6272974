"""NVIDIA GPUs: CUDA kernel events are the units of work; L2 is flushed the way do_bench does."""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from fusionlab.devices import Device, register_device

_FLUSH_BYTES = 256 * 2**20  # triton.testing.do_bench zeroes a 256 MB buffer between reps


@register_device
class CudaDevice(Device):
    """One CUDA device (the current one; workers get theirs through CUDA_VISIBLE_DEVICES)."""

    type = "cuda"
    auto_priority = 20
    event_device_types: ClassVar[tuple[DeviceType, ...]] = (DeviceType.CUDA,)

    def __init__(self) -> None:
        self._flush_buffer: torch.Tensor | None = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if torch.cuda.is_available() else "no CUDA device is visible"

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def profiler_activities(self) -> list[ProfilerActivity]:
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def hardware_name(self) -> str:
        return torch.cuda.get_device_name()

    def cache_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)

    def flush_cache(self) -> None:
        if self._flush_buffer is None:
            size = max(_FLUSH_BYTES, 2 * self.cache_bytes())
            self._flush_buffer = torch.empty(size, dtype=torch.int8, device="cuda")
        self._flush_buffer.zero_()

    def time_one(self, call: Callable[[], object]) -> tuple[object, float]:
        # CUDA events, as triton.testing.do_bench: the host's clock would add launch latency.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = call()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)

    def toolchain(self) -> dict[str, str]:
        versions = {"cuda": str(torch.version.cuda)}
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions["triton"] = importlib.metadata.version("triton")
        return versions

    def visible_env(self, index: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": str(index)}

    def available_memory(self) -> int | None:
        return int(torch.cuda.mem_get_info()[0])

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def profiler_extra(self, trace_dir: str | None) -> dict[str, Any]:
        return {}

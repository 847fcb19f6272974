"""The host CPU: operator records stand in for device events; caches are defeated by rotation."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from fusionlab.devices import Device, register_device

_FALLBACK_CACHE_BYTES = 32 * 2**20


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _size_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def last_level_cache_bytes() -> int:
    """The largest cache sysfs reports for cpu0 (the LLC), or 32 MiB when it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            sizes.append(_size_bytes((index / "size").read_text()))
        except (OSError, ValueError):
            continue
    return max(sizes, default=_FALLBACK_CACHE_BYTES)


@register_device
class CpuDevice(Device):
    """The host CPU, with torch's intra-op thread pool."""

    type = "cpu"
    auto_priority = 0

    def hardware_name(self) -> str:
        return f"{_cpu_model()} ({torch.get_num_threads()} threads)"

    def cache_bytes(self) -> int:
        return last_level_cache_bytes()

    def available_memory(self) -> int | None:
        try:
            with open("/proc/meminfo", encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

"""The host CPU: operator records stand in for device events; caches are defeated by rotation."""

from __future__ import annotations

import platform
from pathlib import Path

from fusionlab.devices import Device, register_device

_FALLBACK_CACHE_BYTES = 32 * 2**20  # when sysfs does not say
_CACHE_ROOT = Path("/sys/devices/system/cpu/cpu0/cache")


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
    """sysfs cache sizes: '32768K', '1M', or plain bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def cpu_llc_bytes(root: Path = _CACHE_ROOT) -> int | None:
    """Size of cpu0's highest-level data/unified cache from sysfs, or None when not exposed."""
    best: tuple[int, int] | None = None
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


@register_device
class CpuDevice(Device):
    """The host CPU, with torch's intra-op thread pool."""

    type = "cpu"
    auto_priority = 0
    cold_sweep_note = (
        "the first sweep builds the C++ kernels (about 15 s each, cached in "
        "~/.cache/fusionlab) and compiles with inductor (cached in /tmp/torchinductor_$USER)"
    )

    def hardware_name(self) -> str:
        return _cpu_model()

    def cache_bytes(self) -> int:
        return cpu_llc_bytes() or _FALLBACK_CACHE_BYTES

    def available_memory(self) -> int | None:
        try:
            with open("/proc/meminfo", encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

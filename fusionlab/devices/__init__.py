"""The device layer: what differs between devices, behind one small interface.

Each device type is one module in this package that subclasses `Device` and calls
`register_device`; modules here are discovered, so adding `mps` or `xpu` is one new file.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from fusionlab.errors import UserError


class Device:
    """One kind of device; `type` is the torch device string."""

    type: ClassVar[str]
    # Where `--device auto` looks first: the highest priority that is usable wins.
    auto_priority: ClassVar[int] = 0
    # Profiler event device types that are work on the device itself (empty: host-only).
    event_device_types: ClassVar[tuple[DeviceType, ...]] = ()
    compile_backend: ClassVar[str] = "inductor"
    # The tool that opens the device profile written to a trace dir ("" when there is none).
    profile_viewer: ClassVar[str] = ""
    # What a cold sweep costs here beyond measuring (shown by `fusionlab list`).
    cold_sweep_note: ClassVar[str] = ""
    # A first compile of a new shape can take minutes on some backends.
    default_timeout_s: ClassVar[float] = 300.0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this device type cannot be used in this process, or None."""
        return None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type)

    def synchronize(self) -> None:
        """Wait for all queued work on the device."""

    def profiler_activities(self) -> list[ProfilerActivity]:
        """The torch.profiler activities used for every variant on this device."""
        return [ProfilerActivity.CPU]

    def profiler_extra(self, trace_dir: str | None) -> dict[str, Any]:
        """Extra keyword arguments for torch.profiler.profile on this device."""
        return {}

    def profile_device_time(self, extra: dict[str, Any], calls: int) -> tuple[float | None, str]:
        """Device seconds per call from the device's own profile output (what `extra` had the
        profiler write), when torch.profiler's events carry none; (None, why) when unknown."""
        return None, ""

    def hardware_name(self) -> str:
        """A name that identifies the hardware, so results from different machines never mix."""
        raise NotImplementedError

    def cache_bytes(self) -> int:
        """The size of the last cache level that timing must defeat to be cache-cold."""
        raise NotImplementedError

    def time_one(self, call: Callable[[], object]) -> tuple[object, float]:
        """One call timed on the device's own clock: its result and milliseconds."""
        self.synchronize()
        start = time.perf_counter()
        result = call()
        self.synchronize()
        return result, (time.perf_counter() - start) * 1e3

    def flush_cache(self) -> None:
        """Evict the device cache between samples where the device supports it (else no-op)."""

    def toolchain(self) -> dict[str, str]:
        """Versions of the device's own software that results depend on."""
        return {}

    def visible_env(self, index: int) -> dict[str, str]:
        """Environment that makes a worker process see only its own device `index`."""
        return {}

    def available_memory(self) -> int | None:
        """Bytes free for tensors on the device, where that can be known."""
        return None

    def device_count(self) -> int:
        """How many devices of this type a host can give separate workers."""
        return 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.type == self.type

    def __hash__(self) -> int:
        return hash(self.type)

    def __repr__(self) -> str:
        return f"Device({self.type!r})"


_DEVICES: dict[str, type[Device]] = {}


def register_device(cls: type[Device]) -> type[Device]:
    """Class decorator: make a device type known to fusionlab."""
    _DEVICES[cls.type] = cls
    return cls


@functools.cache
def _load_builtin() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def device_types() -> tuple[str, ...]:
    """Every registered device type, most preferred by `auto` first."""
    _load_builtin()
    return tuple(sorted(_DEVICES, key=lambda name: -_DEVICES[name].auto_priority))


def __getattr__(name: str) -> Any:
    if name == "DEVICE_TYPES":
        return device_types()
    raise AttributeError(name)


@functools.cache
def get_device(device_type: str) -> Device:
    """The Device for a registered type (whether or not it is usable here)."""
    _load_builtin()
    if device_type not in _DEVICES:
        raise UserError(
            f"unknown device {device_type!r}: choose from auto, {', '.join(device_types())}"
        )
    return _DEVICES[device_type]()


def unavailable_reason(device_type: str) -> str | None:
    """Why a device type cannot be used in this process, or None."""
    _load_builtin()
    cls = _DEVICES.get(device_type)
    return f"unknown device type {device_type!r}" if cls is None else cls.unavailable_reason()


def _current_accelerator() -> str | None:
    """The accelerator torch itself reports (torch.accelerator exists from torch 2.6)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    current = accelerator.current_accelerator()
    return current.type if current is not None else None


def usable_devices() -> Iterator[str]:
    """Usable device types here, most preferred first."""
    return (name for name in device_types() if unavailable_reason(name) is None)


def resolve_device(requested: str) -> Device:
    """Turn `auto` or a device type into a Device that is present, or raise UserError."""
    name = requested.strip().lower()
    if name == "auto":
        accelerator = _current_accelerator()
        if accelerator in device_types() and unavailable_reason(accelerator) is None:
            return get_device(accelerator)
        return get_device(next(usable_devices()))
    device = get_device(name)
    reason = unavailable_reason(name)
    if reason is not None:
        raise UserError(f"device {name!r} is not usable here: {reason}; use --device auto or cpu")
    return device

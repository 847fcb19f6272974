"""The device layer: what differs between CPU, CUDA and Neuron, behind one small interface."""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from fusionlab.errors import UserError

DEVICE_TYPES = ("cpu", "cuda", "neuron")


@dataclass(frozen=True)
class Device:
    """One kind of device; `type` is the torch device string."""

    type: str

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type)

    def synchronize(self) -> None:
        """Wait for all queued work on the device."""
        if self.type == "cuda":
            torch.cuda.synchronize()
        elif self.type == "neuron":
            torch.neuron.synchronize()  # type: ignore[attr-defined]

    def profiler_activities(self) -> list[ProfilerActivity]:
        """The torch.profiler activities used for every variant on this device."""
        if self.type == "cuda":
            return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        if self.type == "neuron":
            return [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
        return [ProfilerActivity.CPU]

    def profiler_extra(self, trace_dir: str | None) -> dict[str, Any]:
        """Extra profiler arguments: on Neuron, the NeuronConfig that writes the device profile."""
        if self.type != "neuron" or trace_dir is None:
            return {}
        # Lazy: Neuron SDK only (tools/neuron-explorer/how-to-profile-pytorch).
        from torch_neuronx.profiling import NeuronConfig, NeuronProfiler, ProfileMode

        config = NeuronConfig(
            modes=[ProfileMode.DEVICE, ProfileMode.RUNTIME], profile_output_dir=trace_dir
        )
        return {
            "experimental_config": config,
            "on_trace_ready": NeuronProfiler(config).export_trace,
        }

    @property
    def event_device_types(self) -> tuple[DeviceType, ...]:
        """Profiler event device types that are work on the device itself (empty on CPU)."""
        if self.type == "cuda":
            return (DeviceType.CUDA,)
        if self.type == "neuron":
            return (DeviceType.PrivateUse1,)
        return ()

    def hardware_name(self) -> str:
        """A name that identifies the hardware, so results from different machines never mix."""
        if self.type == "cuda":
            return torch.cuda.get_device_name()
        if self.type == "neuron":
            return _neuron_name()
        return f"{_cpu_model()} ({torch.get_num_threads()} threads)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _neuron_name() -> str:
    module = getattr(torch, "neuron", None)
    get_name = getattr(module, "get_device_name", None)
    return f"AWS {get_name()}" if callable(get_name) else "AWS Trainium (neuron)"


def neuron_unavailable_reason() -> str | None:
    """Why a `neuron` device cannot be used here, or None when it can."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return "torch-neuronx is not installed (it comes from AWS's Neuron repository, not PyPI)"
    module = getattr(torch, "neuron", None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available):
        return "torch-neuronx is installed but registers no torch.neuron backend"
    if not is_available():
        return "no Neuron device is visible"
    return None


def unavailable_reason(device_type: str) -> str | None:
    """Why a device type cannot be used in this process, or None."""
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible"
    if device_type == "neuron":
        return neuron_unavailable_reason()
    return f"unknown device type {device_type!r}"


def _current_accelerator() -> str | None:
    """The accelerator torch itself reports (torch.accelerator exists from torch 2.6)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    current = accelerator.current_accelerator()
    return current.type if current is not None else None


def resolve_device(requested: str) -> Device:
    """Turn `auto|cpu|cuda|neuron` into a Device that is present, or raise UserError."""
    name = requested.strip().lower()
    if name == "auto":
        accelerator = _current_accelerator()
        if accelerator in DEVICE_TYPES and unavailable_reason(accelerator) is None:
            return Device(accelerator)
        for candidate in ("neuron", "cuda"):
            if unavailable_reason(candidate) is None:
                return Device(candidate)
        return Device("cpu")
    if name not in DEVICE_TYPES:
        raise UserError(
            f"unknown device {requested!r}: choose from auto, {', '.join(DEVICE_TYPES)}"
        )
    reason = unavailable_reason(name)
    if reason is not None:
        raise UserError(f"device {name!r} is not usable here: {reason}; use --device auto or cpu")
    return Device(name)

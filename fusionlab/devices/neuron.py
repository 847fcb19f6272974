"""AWS Trainium through TorchNeuron (the `neuron` PrivateUse1 device); imported lazily."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any, ClassVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from fusionlab.devices import Device, neuron_profile, register_device

_NOT_ON_PYPI = "it comes from AWS's Neuron repository, not PyPI"
_TOOLCHAIN_PACKAGES = ("torch-neuronx", "neuronx-cc", "nki", "libneuronxla")
# SBUF (128 partitions x 224 KiB on Trn2) is the only cache between calls; HBM has none, so a
# rotation larger than SBUF is cold.
_CACHE_BYTES = 128 * 224 * 2**10


@register_device
class NeuronDevice(Device):
    """One NeuronCore (or logical-core group); workers get theirs via NEURON_RT_VISIBLE_CORES."""

    type = "neuron"
    auto_priority = 30
    event_device_types: ClassVar[tuple[DeviceType, ...]] = (DeviceType.PrivateUse1,)
    compile_backend = "neuron"
    profile_viewer = "neuron-explorer view -d DIR"
    cold_sweep_note = (
        "every new (variant, shape, dtype) is compiled by neuronx-cc first: tens of seconds to "
        "minutes each on a cold cache, so a cold default sweep (4 shapes x 2 dtypes x ~8 "
        "configurations) can take an hour or more; the per-trial timeout is "
        f"{neuron_profile.COLD_COMPILE_TIMEOUT_S:.0f} s and first-use costs are reported apart; "
        "compiled NEFFs persist in the Neuron compile caches "
        "(NEURON_COMPILE_CACHE_URL, TORCH_NEURONX_NEFF_CACHE_DIR, NKI_COMPILE_CACHE_URL), "
        "so a second sweep pays only the measurements"
    )
    # neuronx-cc compiles every new shape; a cold compile can take minutes.
    default_timeout_s = neuron_profile.COLD_COMPILE_TIMEOUT_S

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_neuronx") is None:
            return f"torch-neuronx is not installed ({_NOT_ON_PYPI})"
        module = getattr(torch, "neuron", None)
        is_available = getattr(module, "is_available", None)
        if not callable(is_available):
            return "torch-neuronx is installed but registers no torch.neuron backend"
        if not is_available():
            return "no Neuron device is visible"
        return None

    def synchronize(self) -> None:
        torch.neuron.synchronize()  # type: ignore[attr-defined]

    def profiler_activities(self) -> list[ProfilerActivity]:
        return [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]

    def profiler_extra(self, trace_dir: str | None) -> dict[str, Any]:
        # NeuronConfig on every profiled run: it controls the PrivateUse1 activity (RUNTIME mode;
        # DEVICE mode reserves ~5 GB of HBM on Trn2). See neuron_profile.py for the sources.
        kwargs = neuron_profile.profiler_kwargs(trace_dir)
        kwargs.pop("activities", None)  # profiler_activities() gives them to every device alike
        return kwargs

    def profile_device_time(self, extra: dict[str, Any], calls: int) -> tuple[float | None, str]:
        output_dir = getattr(extra, "output_dir", None)
        if output_dir is None:
            return None, "no Neuron profile directory"
        found = neuron_profile.device_time_per_call(output_dir, expected_calls=calls)
        return found.per_call_s, "" if found.reason is None else f"Neuron profile: {found.reason}"

    def hardware_name(self) -> str:
        get_name = getattr(getattr(torch, "neuron", None), "get_device_name", None)
        return f"AWS {get_name()}" if callable(get_name) else "AWS Trainium (neuron)"

    def cache_bytes(self) -> int:
        return _CACHE_BYTES

    def toolchain(self) -> dict[str, str]:
        versions = {}
        for package in _TOOLCHAIN_PACKAGES:
            try:
                versions[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                continue
        return versions

    def visible_env(self, index: int) -> dict[str, str]:
        return {"NEURON_RT_VISIBLE_CORES": str(index)}

    def device_count(self) -> int:
        count = getattr(getattr(torch, "neuron", None), "device_count", None)
        return int(count()) if callable(count) else 1

"""The hand-written RMSNorm kernels registered as variants: C++ on CPU, Triton on CUDA, NKI on
Neuron. Each kernel module imports its toolchain lazily and says why it is unavailable."""

from __future__ import annotations

import functools
from typing import Any

from fusionlab.kernels.rmsnorm import (
    cpu_backward,
    cpu_cpp,
    nki_kernel,
    triton_backward,
    triton_kernel,
)
from fusionlab.kernels.rmsnorm.spec import RMSNORM
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel, register_variant


@register_variant(
    RMSNORM.name,
    "cpp",
    devices=("cpu",),
    tunables=cpu_cpp.TUNABLES,
    backward_tunables={"backward": cpu_backward.BACKWARD_CHOICES},
    available=lambda device_type: cpu_cpp.unavailable_reason(),
    check_params=lambda shape, params, device_type: cpu_cpp.param_error(
        shape, **{k: v for k, v in params.items() if k != "backward"}
    ),
    autograd=True,
    numerics=CASTING_MODES,
)
def cpp(device_type: str, numerics: Numerics = DEFAULT, backward: str = "torch-ops",
        **params: Any) -> Kernel:
    """C++ kernel (torch.utils.cpp_extension): two vectorised passes per row, parallel over rows;
    its backward the torch ops of kernels/norm_grads.py or the fused C++ kernel (with the row
    statistics recomputed, or saved by the forward)."""
    cpu_backward.check_backward(backward)
    if backward != "torch-ops":
        cpu_backward.load_extension()
        fused = {"fused": cpu_backward.rms_norm_cpp_fused_grad,
                 "fused-saved": cpu_backward.rms_norm_cpp_saved_stats}[backward]
        return functools.partial(fused, casting=numerics.casting, offset=numerics.offset,
                                 **params)
    cpu_cpp.load_extension()
    if numerics == DEFAULT:
        return functools.partial(cpu_cpp.rms_norm_cpp, **params)
    return functools.partial(cpu_cpp.rms_norm_cpp_with, casting=numerics.casting,
                             offset=numerics.offset, **params)


@register_variant(
    RMSNORM.name,
    "triton",
    devices=("cuda",),
    tunables=triton_kernel.TUNABLES,
    backward_tunables={"backward": triton_backward.BACKWARD_CHOICES},
    available=triton_kernel.unavailable_reason,
    check_params=lambda shape, params, device_type: triton_kernel.param_error(
        shape, **{k: v for k, v in params.items() if k != "backward"}
    ),
    autograd=True,
)
def triton(device_type: str, backward: str = "torch-ops", **params: Any) -> Kernel:
    """Triton kernel: a [rows, hidden] tile per program, threads_per_row threads on each row;
    its backward the torch ops of kernels/norm_grads.py or the fused Triton kernel."""
    triton_backward.check_backward(backward)
    if backward == "fused":
        return functools.partial(triton_backward.rms_norm_triton_fused_grad, **params)
    return functools.partial(triton_kernel.rms_norm_triton, **params)


@register_variant(
    RMSNORM.name,
    "nki",
    devices=("neuron",),
    tunables=nki_kernel.TUNABLES,
    available=lambda device_type: nki_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: nki_kernel.param_error(shape, **params),
    autograd=False,
)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: rows on the 128 partitions split across logical cores, x kept in SBUF."""
    return functools.partial(nki_kernel.rms_norm_nki, **params)

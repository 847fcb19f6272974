"""The hand-written LayerNorm kernels registered as variants: C++ on CPU, Triton on CUDA, NKI on
Neuron. Each kernel module imports its toolchain lazily and says why it is unavailable."""

from __future__ import annotations

import functools
from typing import Any

from fusionlab.kernels.layernorm import (
    cpu_backward,
    cpu_cpp,
    nki_kernel,
    triton_backward,
    triton_kernel,
)
from fusionlab.kernels.layernorm.spec import LAYERNORM
from fusionlab.kernels.rmsnorm import triton_backward as rms_triton_backward
from fusionlab.registry import Kernel, register_variant


@register_variant(
    LAYERNORM.name,
    "cpp",
    devices=("cpu",),
    tunables=cpu_cpp.TUNABLES,
    backward_tunables={"backward": cpu_backward.BACKWARD_CHOICES},
    available=lambda device_type: cpu_cpp.unavailable_reason(),
    check_params=lambda shape, params, device_type: cpu_cpp.param_error(
        shape, **{k: v for k, v in params.items() if k != "backward"}
    ),
    autograd=True,
)
def cpp(device_type: str, backward: str = "torch-ops", **params: Any) -> Kernel:
    """C++ kernel (torch.utils.cpp_extension): Welford statistics in one read, then the write;
    its backward the torch ops of kernels/norm_grads.py or the fused C++ kernel (with the row
    statistics recomputed, or saved by the forward)."""
    cpu_backward.check_backward(backward)
    if backward != "torch-ops":
        cpu_backward.load_extension()
        fused = {"fused": cpu_backward.layer_norm_cpp_fused_grad,
                 "fused-saved": cpu_backward.layer_norm_cpp_saved_stats}[backward]
        return functools.partial(fused, **params)
    cpu_cpp.load_extension()
    return functools.partial(cpu_cpp.layer_norm_cpp, **params)


@register_variant(
    LAYERNORM.name,
    "nki",
    devices=("neuron",),
    tunables=nki_kernel.TUNABLES,
    available=lambda device_type: nki_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: nki_kernel.param_error(shape, **params),
    autograd=False,
)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: mean and variance in one pass over an SBUF-resident row tile."""
    return functools.partial(nki_kernel.layer_norm_nki, **params)


@register_variant(
    LAYERNORM.name,
    "triton",
    devices=("cuda",),
    tunables=triton_kernel.TUNABLES,
    backward_tunables={"backward": rms_triton_backward.BACKWARD_CHOICES},
    available=lambda device_type: triton_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: triton_kernel.param_error(
        shape, **{k: v for k, v in params.items() if k != "backward"}
    ),
    autograd=True,
)
def triton(device_type: str, backward: str = "torch-ops", **params: Any) -> Kernel:
    """Triton kernel: mean and variance of each row from one read, several rows per program;
    its backward the torch ops of kernels/norm_grads.py or the fused Triton kernel."""
    rms_triton_backward.check_backward(backward)
    if backward == "fused":
        return functools.partial(triton_backward.layer_norm_triton_fused_grad, **params)
    return functools.partial(triton_kernel.layer_norm_triton, **params)

"""The hand-written add + LayerNorm kernels registered as variants: C++ on CPU, Triton on CUDA,
NKI on Neuron. Each reads x and the residual once and writes both results."""

from __future__ import annotations

import functools
from typing import Any

from fusionlab.kernels.add_layernorm import cpu_backward, cpu_cpp, nki_kernel, triton_kernel
from fusionlab.kernels.add_layernorm.spec import ADD_LAYERNORM
from fusionlab.registry import Kernel, register_variant


@register_variant(
    ADD_LAYERNORM.name,
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
    """C++ kernel (torch.utils.cpp_extension): Welford statistics of the fp32 sum in one read of
    x and residual, then both results written; its backward the torch ops of
    kernels/norm_grads.py or the fused C++ kernel."""
    cpu_backward.check_backward(backward)
    if backward == "fused":
        cpu_backward.load_extension()
        return functools.partial(cpu_backward.add_layer_norm_cpp_fused_grad, **params)
    cpu_cpp.load_extension()
    return functools.partial(cpu_cpp.add_layer_norm_cpp, **params)


@register_variant(
    ADD_LAYERNORM.name,
    "nki",
    devices=("neuron",),
    tunables=nki_kernel.TUNABLES,
    available=lambda device_type: nki_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: nki_kernel.param_error(shape, **params),
    autograd=False,
)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: the fp32 sum kept in SBUF, centred, normalised and written with the new
    residual."""
    return functools.partial(nki_kernel.add_layer_norm_nki, **params)


@register_variant(
    ADD_LAYERNORM.name,
    "triton",
    devices=("cuda",),
    tunables=triton_kernel.TUNABLES,
    available=lambda device_type: triton_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: triton_kernel.param_error(shape, **params),
    autograd=True,
)
def triton(device_type: str, **params: Any) -> Kernel:
    """Triton kernel: reads x and residual once, writes the sum and the norm of its fp32 value."""
    return functools.partial(triton_kernel.add_layer_norm_triton, **params)

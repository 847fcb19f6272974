"""The hand-written add + RMSNorm kernels registered as variants: C++ on CPU, Triton on CUDA, NKI
on Neuron. Each reads x and the residual once and writes both results."""

from __future__ import annotations

import functools
from typing import Any

from fusionlab.kernels.add_rmsnorm import cpu_backward, cpu_cpp, nki_kernel, triton_kernel
from fusionlab.kernels.add_rmsnorm.spec import ADD_RMSNORM
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel, register_variant


@register_variant(
    ADD_RMSNORM.name,
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
    """C++ kernel (torch.utils.cpp_extension): fp32 sum of squares, then both results written;
    its backward the torch ops of kernels/norm_grads.py or the fused C++ kernel."""
    cpu_backward.check_backward(backward)
    if backward == "fused":
        cpu_backward.load_extension()
        return functools.partial(cpu_backward.add_rms_norm_cpp_fused_grad,
                                 casting=numerics.casting, offset=numerics.offset, **params)
    cpu_cpp.load_extension()
    if numerics == DEFAULT:
        return functools.partial(cpu_cpp.add_rms_norm_cpp, **params)
    return functools.partial(cpu_cpp.add_rms_norm_cpp_with, casting=numerics.casting,
                             offset=numerics.offset, **params)


@register_variant(
    ADD_RMSNORM.name,
    "cpp-inplace",
    devices=("cpu",),
    tunables=cpu_cpp.INPLACE_TUNABLES,
    available=lambda device_type: cpu_cpp.unavailable_reason(),
    check_params=lambda shape, params, device_type: cpu_cpp.param_error(shape, **params),
    inplace={"y": "x", "residual_out": "residual"},
    autograd=False,
    numerics=CASTING_MODES,
)
def cpp_inplace(device_type: str, numerics: Numerics = DEFAULT, **params: Any) -> Kernel:
    """The C++ kernel in place (vLLM's contract): residual <- x + residual, x <- the norm."""
    cpu_cpp.load_extension()
    if numerics == DEFAULT:
        return functools.partial(cpu_cpp.add_rms_norm_cpp_, **params)
    return functools.partial(cpu_cpp.add_rms_norm_cpp_with_, casting=numerics.casting,
                             offset=numerics.offset, **params)


@register_variant(
    ADD_RMSNORM.name,
    "nki",
    devices=("neuron",),
    tunables=nki_kernel.TUNABLES,
    available=lambda device_type: nki_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: nki_kernel.param_error(shape, **params),
    autograd=False,
)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: the fp32 sum kept in SBUF, normalised and written with the new residual."""
    return functools.partial(nki_kernel.add_rms_norm_nki, **params)


@register_variant(
    ADD_RMSNORM.name,
    "triton",
    devices=("cuda",),
    tunables=triton_kernel.TUNABLES,
    available=lambda device_type: triton_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: triton_kernel.param_error(shape, **params),
    autograd=True,
)
def triton(device_type: str, **params: Any) -> Kernel:
    """Triton kernel: reads x and residual once, writes the fp32 sum and the norm."""
    return functools.partial(triton_kernel.add_rms_norm_triton, **params)


@register_variant(
    ADD_RMSNORM.name,
    "triton-inplace",
    devices=("cuda",),
    tunables=triton_kernel.TUNABLES,
    available=lambda device_type: triton_kernel.unavailable_reason(),
    check_params=lambda shape, params, device_type: triton_kernel.param_error(shape, **params),
    inplace={"y": "x", "residual_out": "residual"},
    autograd=False,
)
def triton_inplace(device_type: str, **params: Any) -> Kernel:
    """The Triton kernel writing y into x and the sum into residual (vLLM's contract)."""
    return functools.partial(triton_kernel.add_rms_norm_triton_, **params)

"""The hand-written add + RMSNorm kernels registered as variants: C++ on CPU, Triton on CUDA, NKI
on Neuron. Each reads x and the residual once and writes both results."""

from __future__ import annotations

from typing import Any

from fusionlab.kernels.add_rmsnorm import cpu_backward, cpu_cpp, nki_kernel, triton_kernel
from fusionlab.kernels.add_rmsnorm.spec import ADD_RMSNORM
from fusionlab.kernels.common.kernel_choice import chosen_kernel
from fusionlab.kernels.common.registration import register_handwritten, with_numerics
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel

_IN_PLACE = {"y": "x", "residual_out": "residual"}  # vLLM's contract


@register_handwritten(ADD_RMSNORM.name, "cpp", cpu_cpp, devices=("cpu",), autograd=True,
                      backward_choices=cpu_backward.BACKWARD_CHOICES, numerics=CASTING_MODES)
def cpp(device_type: str, numerics: Numerics = DEFAULT, backward: str = "torch-ops",
        **params: Any) -> Kernel:
    """C++ kernel (torch.utils.cpp_extension): fp32 sum of squares, then both results written;
    its backward the torch ops of kernels/norm_grads.py or the fused C++ kernel."""
    return chosen_kernel(backward, {"fused": cpu_backward.add_rms_norm_cpp_fused_grad},
                         cpu_cpp.add_rms_norm_cpp, params, load_fused=cpu_backward.load_extension,
                         load=cpu_cpp.load_extension, numerics=numerics,
                         forward_with=cpu_cpp.add_rms_norm_cpp_with)


@register_handwritten(ADD_RMSNORM.name, "cpp-inplace", cpu_cpp, devices=("cpu",),
                      autograd=False, tunables=cpu_cpp.INPLACE_TUNABLES, inplace=_IN_PLACE,
                      numerics=CASTING_MODES)
def cpp_inplace(device_type: str, numerics: Numerics = DEFAULT, **params: Any) -> Kernel:
    """The C++ kernel in place (vLLM's contract): residual <- x + residual, x <- the norm."""
    return chosen_kernel("torch-ops", {}, cpu_cpp.add_rms_norm_cpp_, params,
                         load=cpu_cpp.load_extension, numerics=numerics,
                         forward_with=cpu_cpp.add_rms_norm_cpp_with_)


@register_handwritten(ADD_RMSNORM.name, "nki", nki_kernel, devices=("neuron",), autograd=False)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: the fp32 sum kept in SBUF, normalised and written with the new residual."""
    return with_numerics(nki_kernel.add_rms_norm_nki, None, params)


@register_handwritten(ADD_RMSNORM.name, "triton", triton_kernel, devices=("cuda",),
                      autograd=True)
def triton(device_type: str, **params: Any) -> Kernel:
    """Triton kernel: reads x and residual once, writes the fp32 sum and the norm."""
    return with_numerics(triton_kernel.add_rms_norm_triton, None, params)


@register_handwritten(ADD_RMSNORM.name, "triton-inplace", triton_kernel, devices=("cuda",),
                      autograd=False, inplace=_IN_PLACE)
def triton_inplace(device_type: str, **params: Any) -> Kernel:
    """The Triton kernel writing y into x and the sum into residual (vLLM's contract)."""
    return with_numerics(triton_kernel.add_rms_norm_triton_, None, params)

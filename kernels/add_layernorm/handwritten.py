"""The hand-written add + LayerNorm kernels registered as variants: C++ on CPU, Triton on CUDA,
NKI on Neuron. Each reads x and the residual once and writes both results."""

from __future__ import annotations

from typing import Any

from fusionlab.kernels.add_layernorm import cpu_backward, cpu_cpp, nki_kernel, triton_kernel
from fusionlab.kernels.add_layernorm.spec import ADD_LAYERNORM
from fusionlab.kernels.common.kernel_choice import chosen_kernel
from fusionlab.kernels.common.registration import register_handwritten, with_numerics
from fusionlab.registry import Kernel


@register_handwritten(ADD_LAYERNORM.name, "cpp", cpu_cpp, devices=("cpu",), autograd=True,
                      backward_choices=cpu_backward.BACKWARD_CHOICES)
def cpp(device_type: str, backward: str = "torch-ops", **params: Any) -> Kernel:
    """C++ kernel (torch.utils.cpp_extension): Welford statistics of the fp32 sum in one read of
    x and residual, then both results written; its backward the torch ops of
    kernels/norm_grads.py or the fused C++ kernel."""
    return chosen_kernel(backward, {"fused": cpu_backward.add_layer_norm_cpp_fused_grad},
                         cpu_cpp.add_layer_norm_cpp, params,
                         load_fused=cpu_backward.load_extension, load=cpu_cpp.load_extension)


@register_handwritten(ADD_LAYERNORM.name, "nki", nki_kernel, devices=("neuron",), autograd=False)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: the fp32 sum kept in SBUF, centred, normalised and written with the new
    residual."""
    return with_numerics(nki_kernel.add_layer_norm_nki, None, params)


@register_handwritten(ADD_LAYERNORM.name, "triton", triton_kernel, devices=("cuda",),
                      autograd=True)
def triton(device_type: str, **params: Any) -> Kernel:
    """Triton kernel: reads x and residual once, writes the sum and the norm of its fp32 value."""
    return with_numerics(triton_kernel.add_layer_norm_triton, None, params)

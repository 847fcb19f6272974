"""The hand-written LayerNorm kernels registered as variants: C++ on CPU, Triton on CUDA, NKI on
Neuron. Each kernel module imports its toolchain lazily and says why it is unavailable."""

from __future__ import annotations

from typing import Any

from fusionlab.kernels.common.backward_choices import RECOMPUTING_CHOICES
from fusionlab.kernels.common.kernel_choice import chosen_kernel, register_with_fused_backward
from fusionlab.kernels.common.registration import register_handwritten, with_numerics
from fusionlab.kernels.layernorm import cpu_backward, cpu_cpp, nki_kernel, triton_kernel
from fusionlab.kernels.layernorm.spec import LAYERNORM
from fusionlab.kernels.layernorm.triton_backward import layer_norm_triton_fused_grad
from fusionlab.registry import Kernel


@register_handwritten(LAYERNORM.name, "cpp", cpu_cpp, devices=("cpu",), autograd=True,
                      backward_choices=cpu_backward.BACKWARD_CHOICES)
def cpp(device_type: str, backward: str = "torch-ops", **params: Any) -> Kernel:
    """C++ kernel (torch.utils.cpp_extension): Welford statistics in one read, then the write;
    its backward the torch ops of kernels/norm_grads.py or the fused C++ kernel (with the row
    statistics recomputed, or saved by the forward)."""
    return chosen_kernel(backward, {"fused": cpu_backward.layer_norm_cpp_fused_grad,
                                    "fused-saved": cpu_backward.layer_norm_cpp_saved_stats},
                         cpu_cpp.layer_norm_cpp, params, load_fused=cpu_backward.load_extension,
                         load=cpu_cpp.load_extension)


@register_handwritten(LAYERNORM.name, "nki", nki_kernel, devices=("neuron",), autograd=False)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: mean and variance in one pass over an SBUF-resident row tile."""
    return with_numerics(nki_kernel.layer_norm_nki, None, params)


# Its backward the torch ops of kernels/norm_grads.py or the fused Triton kernel.
register_with_fused_backward(
    LAYERNORM.name, "triton", triton_kernel, triton_kernel.layer_norm_triton,
    layer_norm_triton_fused_grad, devices=("cuda",), backward_choices=RECOMPUTING_CHOICES,
    description="Triton kernel: mean and variance of each row from one read, several rows per "
    "program;")

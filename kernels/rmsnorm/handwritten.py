"""The hand-written RMSNorm kernels registered as variants: C++ on CPU, Triton on CUDA, NKI on
Neuron. Each kernel module imports its toolchain lazily and says why it is unavailable."""

from __future__ import annotations

from typing import Any

from fusionlab.kernels.common.kernel_choice import chosen_kernel, register_with_fused_backward
from fusionlab.kernels.common.registration import register_handwritten, with_numerics
from fusionlab.kernels.rmsnorm import cpu_backward, cpu_cpp, nki_kernel, triton_kernel
from fusionlab.kernels.rmsnorm.spec import RMSNORM
from fusionlab.kernels.rmsnorm.triton_backward import BACKWARD_CHOICES, rms_norm_triton_fused_grad
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel


@register_handwritten(RMSNORM.name, "cpp", cpu_cpp, devices=("cpu",), autograd=True,
                      backward_choices=cpu_backward.BACKWARD_CHOICES, numerics=CASTING_MODES)
def cpp(device_type: str, numerics: Numerics = DEFAULT, backward: str = "torch-ops",
        **params: Any) -> Kernel:
    """C++ kernel (torch.utils.cpp_extension): two vectorised passes per row, parallel over rows;
    its backward the torch ops of kernels/norm_grads.py or the fused C++ kernel (with the row
    statistics recomputed, or saved by the forward)."""
    return chosen_kernel(backward, {"fused": cpu_backward.rms_norm_cpp_fused_grad,
                                    "fused-saved": cpu_backward.rms_norm_cpp_saved_stats},
                         cpu_cpp.rms_norm_cpp, params, load_fused=cpu_backward.load_extension,
                         load=cpu_cpp.load_extension, numerics=numerics,
                         forward_with=cpu_cpp.rms_norm_cpp_with)


# Its backward the torch ops of kernels/norm_grads.py or the fused Triton kernel.
register_with_fused_backward(
    RMSNORM.name, "triton", triton_kernel, triton_kernel.rms_norm_triton,
    rms_norm_triton_fused_grad, devices=("cuda",), backward_choices=BACKWARD_CHOICES,
    description="Triton kernel: a [rows, hidden] tile per program, threads_per_row threads on "
    "each row;")


@register_handwritten(RMSNORM.name, "nki", nki_kernel, devices=("neuron",), autograd=False)
def nki(device_type: str, **params: Any) -> Kernel:
    """NKI kernel: rows on the 128 partitions split across logical cores, x kept in SBUF."""
    return with_numerics(nki_kernel.rms_norm_nki, None, params)

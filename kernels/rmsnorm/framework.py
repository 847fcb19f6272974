"""The framework lowerings of RMSNorm: the naive ATen chain, torch.rms_norm and torch.compile."""

from __future__ import annotations

import torch

from fusionlab.kernels.common.rms_math import naive_rmsnorm, rmsnorm_with
from fusionlab.kernels.framework_variants import register_framework_variants
from fusionlab.kernels.rmsnorm.spec import RMSNORM
from fusionlab.numerics import Numerics
from fusionlab.registry import Kernel


def builtin_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def chain_with(numerics: Numerics) -> Kernel:
    """rmsnorm_with bound to `numerics`, as a plain function torch.compile can copy."""

    def rmsnorm_chain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm_with(x, weight, eps, numerics)

    return rmsnorm_chain


def builtin_offset(numerics: Numerics) -> Kernel:
    """torch.rms_norm with an fp32 weight plus the offset of `numerics`."""
    offset = numerics.offset

    def builtin_rmsnorm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # An fp32 weight: torch.rms_norm multiplies in fp32 and rounds once, as Gemma does.
        return torch.rms_norm(x, (x.shape[-1],), offset + weight.to(torch.float32), eps)

    return builtin_rmsnorm_offset


register_framework_variants(
    RMSNORM.name, naive_rmsnorm, builtin_rmsnorm, (
        "Square, mean, add eps, rsqrt and two multiplies as separate ATen ops.",
        "torch.rms_norm (aten::rms_norm, fused where the backend has a fused kernel).",
        "torch.compile of the naive chain (inductor on cpu/cuda, the neuron backend on neuron).",
    ),
    naive_with=chain_with,
    builtin_with=builtin_offset,
    exact_casts=lambda numerics: numerics.rounds_normed,
)

"""The framework lowerings of RMSNorm: the naive ATen chain, torch.rms_norm and torch.compile."""

from __future__ import annotations

import torch

from fusionlab.kernels.common.rms_math import naive_rmsnorm, rmsnorm_with
from fusionlab.kernels.compiling import COMPILE_TUNABLES, compile_rejects, compiled_copy
from fusionlab.kernels.rmsnorm.spec import RMSNORM
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel, register_variant


def builtin_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def chain_with(numerics: Numerics) -> Kernel:
    """rmsnorm_with bound to `numerics`, as a plain function torch.compile can copy."""

    def rmsnorm_chain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm_with(x, weight, eps, numerics)

    return rmsnorm_chain


@register_variant(
    RMSNORM.name, "naive", devices=("cpu", "cuda", "neuron"), kind="baseline",
    numerics=CASTING_MODES,
)
def naive(device_type: str, numerics: Numerics = DEFAULT) -> Kernel:
    """Square, mean, add eps, rsqrt and two multiplies as separate ATen ops."""
    return naive_rmsnorm if numerics == DEFAULT else chain_with(numerics)


@register_variant(
    RMSNORM.name, "builtin", devices=("cpu", "cuda", "neuron"), kind="builtin",
    numerics=("none", "gemma"),
)
def builtin(device_type: str, numerics: Numerics = DEFAULT) -> Kernel:
    """torch.rms_norm (aten::rms_norm, fused where the backend has a fused kernel)."""
    if numerics == DEFAULT:
        return builtin_rmsnorm
    if numerics.rounds_normed:
        raise ValueError("builtin rmsnorm cannot round the normalised row (casting 'llama')")
    offset = numerics.offset

    def builtin_rmsnorm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # An fp32 weight: torch.rms_norm multiplies in fp32 and rounds once, as Gemma does.
        return torch.rms_norm(x, (x.shape[-1],), offset + weight.to(torch.float32), eps)

    return builtin_rmsnorm_offset


@register_variant(
    RMSNORM.name,
    "compiled",
    devices=("cpu", "cuda", "neuron"),
    tunables=COMPILE_TUNABLES,
    check_params=compile_rejects,
    kind="compiled",
    numerics=CASTING_MODES,
)
def compiled(
    device_type: str, mode: str, dynamic: bool, numerics: Numerics = DEFAULT
) -> Kernel:
    """torch.compile of the naive chain (inductor on cpu/cuda, the neuron backend on neuron)."""
    chain = naive_rmsnorm if numerics == DEFAULT else chain_with(numerics)
    return compiled_copy(chain, device_type, mode, dynamic, numerics.rounds_normed)

"""The framework lowerings of RMSNorm: the naive ATen chain, torch.rms_norm and torch.compile."""

from __future__ import annotations

import torch

from fusionlab.kernels.compiling import COMPILE_TUNABLES, compile_rejects, compiled_copy
from fusionlab.kernels.rmsnorm.spec import RMSNORM
from fusionlab.registry import Kernel, register_variant


def naive_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The seed's chain, one ATen op at a time (16-bit inputs computed in float32, as models do)."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    variance = (h * h).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if x.dtype != torch.float32:
        h = h.to(x.dtype)
    return h * weight


def builtin_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


@register_variant(RMSNORM.name, "naive", devices=("cpu", "cuda", "neuron"), kind="baseline")
def naive(device_type: str) -> Kernel:
    """Square, mean, add eps, rsqrt and two multiplies as separate ATen ops."""
    return naive_rmsnorm


@register_variant(RMSNORM.name, "builtin", devices=("cpu", "cuda", "neuron"), kind="builtin")
def builtin(device_type: str) -> Kernel:
    """torch.rms_norm (aten::rms_norm, fused where the backend has a fused kernel)."""
    return builtin_rmsnorm


@register_variant(
    RMSNORM.name,
    "compiled",
    devices=("cpu", "cuda", "neuron"),
    tunables=COMPILE_TUNABLES,
    check_params=compile_rejects,
    kind="compiled",
)
def compiled(device_type: str, mode: str, dynamic: bool) -> Kernel:
    """torch.compile of the naive chain (inductor on cpu/cuda, the neuron backend on neuron)."""
    return compiled_copy(naive_rmsnorm, device_type, mode, dynamic)

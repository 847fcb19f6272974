"""The framework lowerings of LayerNorm: the naive ATen chain, F.layer_norm and torch.compile."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionlab.kernels.compiling import COMPILE_TUNABLES, compile_rejects, compiled_copy
from fusionlab.kernels.layernorm.spec import LAYERNORM
from fusionlab.registry import Kernel, register_variant

_DEVICES = ("cpu", "cuda", "neuron")


def naive_layernorm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mean, subtract, variance, rsqrt, multiply and add as separate ATen ops (16-bit in fp32)."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    centered = h - h.mean(-1, keepdim=True)
    variance = (centered * centered).mean(-1, keepdim=True)
    h = centered * torch.rsqrt(variance + eps)
    if x.dtype != torch.float32:
        h = h.to(x.dtype)
    return h * weight + bias


def builtin_layernorm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@register_variant(LAYERNORM.name, "naive", devices=_DEVICES, kind="baseline")
def naive(device_type: str) -> Kernel:
    """Mean, subtract, variance, rsqrt, multiply and add as separate ATen ops."""
    return naive_layernorm


@register_variant(LAYERNORM.name, "builtin", devices=_DEVICES, kind="builtin")
def builtin(device_type: str) -> Kernel:
    """torch.nn.functional.layer_norm (aten::layer_norm, one native kernel)."""
    return builtin_layernorm


@register_variant(
    LAYERNORM.name,
    "compiled",
    devices=_DEVICES,
    tunables=COMPILE_TUNABLES,
    check_params=compile_rejects,
    kind="compiled",
)
def compiled(device_type: str, mode: str, dynamic: bool) -> Kernel:
    """torch.compile of the naive chain (inductor on cpu/cuda, the neuron backend on neuron)."""
    return compiled_copy(naive_layernorm, device_type, mode, dynamic)

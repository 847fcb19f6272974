"""The framework lowerings of LayerNorm: the naive ATen chain, F.layer_norm and torch.compile."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionlab.kernels.framework_variants import register_framework_variants
from fusionlab.kernels.layernorm.spec import LAYERNORM


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


register_framework_variants(LAYERNORM.name, naive_layernorm, builtin_layernorm, (
    "Mean, subtract, variance, rsqrt, multiply and add as separate ATen ops.",
    "torch.nn.functional.layer_norm (aten::layer_norm, one native kernel).",
    "torch.compile of the naive chain (inductor on cpu/cuda, the neuron backend on neuron).",
))

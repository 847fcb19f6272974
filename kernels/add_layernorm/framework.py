"""The framework lowerings of add + LayerNorm: the add followed by the naive LayerNorm chain, the
add followed by F.layer_norm, and torch.compile of the naive chain."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionlab.kernels.add_layernorm.spec import ADD_LAYERNORM
from fusionlab.kernels.framework_variants import register_framework_variants
from fusionlab.kernels.layernorm.framework import naive_layernorm

Pair = tuple[torch.Tensor, torch.Tensor]


def naive_add_layernorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> Pair:
    """The add in float32, stored in x's dtype, then LayerNorm of the float32 sum, op by op."""
    total = x.float() + residual.float()
    out = naive_layernorm(total, weight.float(), bias.float(), eps)
    return out.to(x.dtype), total.to(x.dtype)


def builtin_add_layernorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> Pair:
    total = x + residual
    return F.layer_norm(total, (x.shape[-1],), weight, bias, eps), total


register_framework_variants(ADD_LAYERNORM.name, naive_add_layernorm, builtin_add_layernorm, (
    "x + residual, then mean, subtract, variance, rsqrt, multiply and add as separate ops.",
    "x + residual, then torch.nn.functional.layer_norm (the model's own two ops).",
    "torch.compile of the naive chain: inductor fuses the add into the norm.",
))

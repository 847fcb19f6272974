"""The fused residual-add + LayerNorm op spec (the post-attention block of a GPT-2-style layer):
residual_out = x + residual; y = layernorm(residual_out) * weight + bias. The sum is returned
because the residual stream reuses it, as add_rmsnorm's (vLLM's fused_add_rms_norm contract)."""

from __future__ import annotations

import torch

from fusionlab.kernels.common.norm_spec import register_norm_op
from fusionlab.kernels.layernorm.spec import EPS, layer_norm_float64
from fusionlab.op import Inputs, Shape


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Activations, a residual stream of larger magnitude with a non-zero mean (so the centring
    matters), and a weight and bias far from ones and zeros, from a seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    residual = 0.5 + 2.0 * torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    bias = 0.5 * torch.randn(shape[-1], generator=generator)
    return (*(t.to(device=device, dtype=dtype) for t in (x, residual, weight, bias)), EPS)


def add_layer_norm_float64(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) in float64 on the CPU from the exact sum. Differentiable: no detach."""
    total = x.to("cpu", torch.float64) + residual.to("cpu", torch.float64)
    return layer_norm_float64(total, weight, bias, eps), total


ADD_LAYERNORM = register_norm_op(
    name="add_layernorm",
    description="residual add fused with LayerNorm: (layernorm(x + residual), x + residual)",
    inputs=("x", "residual", "weight", "bias", "eps"),
    outputs=("y", "residual_out"), make_inputs=make_inputs,
    float64=add_layer_norm_float64,
    rows_moved=4, vectors_moved=2,
    moved="Read x, residual, weight and bias; write y and the new residual.",
    # GPT-2 small/XL and a wider model; decode (1 row) to long prefill.
    default_shapes="1x768,128x768,2048x1600,2048x4096",
    quick_shapes="1x768,256x1600",
)

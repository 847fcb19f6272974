"""The LayerNorm op spec: y = (x - mean) * rsqrt(var + eps) * weight + bias, over the last dim."""

from __future__ import annotations

import torch

from fusionlab.kernels.common.norm_spec import register_norm_op
from fusionlab.op import Inputs, Shape

EPS = 1e-5


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Activations with a non-zero mean (so the subtraction matters), and a weight and bias far
    from ones and zeros, from a seed."""
    generator = torch.Generator().manual_seed(seed)
    x = 0.5 + torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    bias = 0.5 * torch.randn(shape[-1], generator=generator)
    return (*(t.to(device=device, dtype=dtype) for t in (x, weight, bias)), EPS)


def layer_norm_float64(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm in float64 on the CPU (biased variance, as torch.nn.functional.layer_norm)."""
    x64, w64, b64 = (t.to("cpu", torch.float64) for t in (x, weight, bias))
    mean = x64.mean(-1, keepdim=True)
    variance = (x64 - mean).square().mean(-1, keepdim=True)
    return (x64 - mean) * torch.rsqrt(variance + eps) * w64 + b64


LAYERNORM = register_norm_op(
    name="layernorm",
    description="LayerNorm over the last dimension, with a learned weight and bias",
    inputs=("x", "weight", "bias", "eps"),
    outputs=("y",), make_inputs=make_inputs,
    float64=layer_norm_float64,
    rows_moved=2, vectors_moved=2, moved="Read x, weight and bias, write y.",
    default_shapes="1x4096,32x4096,512x4096,2048x8192",
    quick_shapes="1x4096,256x4096",
)

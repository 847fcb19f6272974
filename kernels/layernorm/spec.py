"""The LayerNorm op spec: y = (x - mean) * rsqrt(var + eps) * weight + bias, over the last dim."""

from __future__ import annotations

import math

import torch

from fusionlab.kernels.common.tolerances import TOLERANCES
from fusionlab.op import Inputs, OpSpec, Shape, Tolerance
from fusionlab.registry import register_op

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


def reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """LayerNorm in float64 on the CPU."""
    x, weight, bias, eps = inputs
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    assert isinstance(bias, torch.Tensor)
    return (layer_norm_float64(x.detach(), weight.detach(), bias.detach(), float(eps)),)  # type: ignore[arg-type]


def grad_reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The reference as differentiable float64 ops (the gradient gate differentiates it)."""
    x, weight, bias, eps = inputs
    return (layer_norm_float64(x, weight, bias, float(eps)),)  # type: ignore[arg-type]


def bytes_moved(shape: Shape, dtype: torch.dtype) -> int:
    """Read x, weight and bias, write y."""
    return (2 * math.prod(shape) + 2 * shape[-1]) * dtype.itemsize


def tolerance(dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[dtype]


LAYERNORM = register_op(
    OpSpec(
        name="layernorm",
        rowwise=True,
        description="LayerNorm over the last dimension, with a learned weight and bias",
        inputs=("x", "weight", "bias", "eps"),
        outputs=("y",),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=bytes_moved,
        tolerance=tolerance,
        baseline="naive",
        builtin="builtin",
        default_shapes="1x4096,32x4096,512x4096,2048x8192",
        quick_shapes="1x4096,256x4096",
        grad_inputs=("x", "weight", "bias"),
        grad_reference=grad_reference,
    )
)

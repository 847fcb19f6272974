"""The RMSNorm op spec: y = x * rsqrt(mean(x^2, last dim) + eps) * weight."""

from __future__ import annotations

import math

import torch

from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.op import Inputs, OpSpec, Shape, Tolerance
from fusionlab.registry import register_op

EPS = 1e-6
TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Normal activations and a weight around 1 that is far from all ones, from a seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), EPS


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float64 copies on the CPU."""
    x64 = x.detach().to("cpu", torch.float64)
    w64 = weight.detach().to("cpu", torch.float64)
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w64


def reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    x, weight, eps = inputs
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    return (rms_norm_float64(x, weight, float(eps)),)  # type: ignore[arg-type]


def rms_norm_float64_with(
    x: torch.Tensor, weight: torch.Tensor, eps: float, numerics: Numerics,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RMSNorm in float64 under `numerics`; "llama" rounds the normalised row to `dtype` (default
    x's), its gradient passing straight through the rounding. Differentiable: no detach."""
    x64 = x.to("cpu", torch.float64)
    normed = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    if numerics.rounds_normed:
        normed = normed.to(dtype or x.dtype).to(torch.float64)
    return normed * (numerics.offset + weight.to("cpu", torch.float64))


def reference_with(inputs: Inputs, numerics: Numerics) -> tuple[torch.Tensor, ...]:
    """The float64 reference of a module with these numerics (`reference` is casting "none")."""
    x, weight, eps = inputs
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    return (rms_norm_float64_with(x.detach(), weight.detach(), float(eps), numerics),)  # type: ignore[arg-type]


def grad_reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The reference as differentiable float64 ops (the gradient gate differentiates it)."""
    x, weight, eps = inputs
    return (rms_norm_float64_with(x, weight, float(eps), DEFAULT),)  # type: ignore[arg-type]


def bytes_moved(shape: Shape, dtype: torch.dtype) -> int:
    """Read x and weight, write y."""
    return (2 * math.prod(shape) + shape[-1]) * dtype.itemsize


def tolerance(dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[dtype]


RMSNORM = register_op(
    OpSpec(
        name="rmsnorm",
        rowwise=True,
        description="RMSNorm over the last dimension, with a learned weight",
        inputs=("x", "weight", "eps"),
        outputs=("y",),
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=bytes_moved,
        tolerance=tolerance,
        baseline="naive",
        builtin="builtin",
        default_shapes="1x4096,32x4096,512x4096,2048x8192",
        quick_shapes="1x4096,256x4096",
        grad_inputs=("x", "weight"),
        grad_reference=grad_reference,
    )
)

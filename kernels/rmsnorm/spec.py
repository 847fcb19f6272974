"""The RMSNorm op spec: y = x * rsqrt(mean(x^2, last dim) + eps) * weight."""

from __future__ import annotations

import math

import torch

from fusionlab.kernels.common.rms_math import EPS, rms_norm_float64, rms_norm_float64_with
from fusionlab.kernels.common.tolerances import TOLERANCES
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.op import Inputs, OpSpec, Shape, Tolerance
from fusionlab.registry import register_op


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Normal activations and a weight around 1 that is far from all ones, from a seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), EPS


def reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    x, weight, eps = inputs
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    return (rms_norm_float64(x, weight, float(eps)),)  # type: ignore[arg-type]


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

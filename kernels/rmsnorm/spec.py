"""The RMSNorm op spec: y = x * rsqrt(mean(x^2, last dim) + eps) * weight."""

from __future__ import annotations

import functools

import torch

from fusionlab.kernels.common.norm_spec import float64_reference, register_norm_op
from fusionlab.kernels.common.rms_math import EPS, rms_norm_float64_with
from fusionlab.kernels.common.tolerances import TOLERANCES
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.op import Inputs, Shape

__all__ = ["EPS", "RMSNORM", "TOLERANCES", "make_inputs", "reference", "reference_with",
           "rms_norm_float64_with"]


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Normal activations and a weight around 1 that is far from all ones, from a seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), EPS


def reference_with(inputs: Inputs, numerics: Numerics) -> tuple[torch.Tensor, ...]:
    """The float64 reference of a module with these numerics (`reference` is casting "none")."""
    return float64_reference(functools.partial(rms_norm_float64_with, numerics=numerics), inputs)


RMSNORM = register_norm_op(
    name="rmsnorm",
    description="RMSNorm over the last dimension, with a learned weight",
    inputs=("x", "weight", "eps"),
    outputs=("y",), make_inputs=make_inputs,
    float64=functools.partial(rms_norm_float64_with, numerics=DEFAULT),
    rows_moved=2, vectors_moved=1, moved="Read x and weight, write y.",
    default_shapes="1x4096,32x4096,512x4096,2048x8192",
    quick_shapes="1x4096,256x4096",
)
reference = RMSNORM.reference

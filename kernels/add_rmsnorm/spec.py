"""The fused residual-add + RMSNorm op spec (the pre-norm block of an LLM layer):
residual_out = x + residual; y = rmsnorm(residual_out) * weight."""

from __future__ import annotations

import functools

import torch

from fusionlab.kernels.common.norm_spec import float64_reference, register_norm_op
from fusionlab.kernels.common.rms_math import EPS, rms_norm_float64_with
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.op import Inputs, Shape


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    """Activations, a residual stream of larger magnitude, and a weight far from all ones."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    residual = 2.0 * torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return (*(t.to(device=device, dtype=dtype) for t in (x, residual, weight)), EPS)


def add_rms_norm_float64_with(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, numerics: Numerics,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) in float64 under `numerics`: "llama" and "gemma" round the sum to `dtype`
    (default x's) first, as a model's separate add does. Differentiable: no detach."""
    dtype = dtype or x.dtype
    total = x.to("cpu", torch.float64) + residual.to("cpu", torch.float64)
    if numerics.rounds_sum:
        total = total.to(dtype).to(torch.float64)
    return rms_norm_float64_with(total, weight, eps, numerics, dtype), total


def reference_with(inputs: Inputs, numerics: Numerics) -> tuple[torch.Tensor, ...]:
    """The float64 reference of a layer with these numerics (`reference` is casting "none")."""
    return float64_reference(functools.partial(add_rms_norm_float64_with, numerics=numerics),
                             inputs)


ADD_RMSNORM = register_norm_op(
    name="add_rmsnorm",
    description="residual add fused with RMSNorm: (rmsnorm(x + residual), x + residual)",
    inputs=("x", "residual", "weight", "eps"),
    outputs=("y", "residual_out"), make_inputs=make_inputs,
    float64=functools.partial(add_rms_norm_float64_with, numerics=DEFAULT),
    rows_moved=4, vectors_moved=1,
    moved="Read x, residual and weight; write y and the new residual.",
    default_shapes="1x4096,128x4096,2048x4096,2048x8192",
    quick_shapes="1x4096,256x4096",
)
reference = ADD_RMSNORM.reference

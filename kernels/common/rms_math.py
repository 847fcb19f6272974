"""RMSNorm's math that add + RMSNorm reuses: the float64 references the gate compares against and
the ATen chains of the framework lowerings."""

from __future__ import annotations

import torch

from fusionlab.numerics import Numerics

EPS = 1e-6


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float64 copies on the CPU."""
    x64 = x.detach().to("cpu", torch.float64)
    w64 = weight.detach().to("cpu", torch.float64)
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w64


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


def naive_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The seed's chain, one ATen op at a time (16-bit inputs computed in float32, as models do)."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    variance = (h * h).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if x.dtype != torch.float32:
        h = h.to(x.dtype)
    return h * weight


def rmsnorm_with(
    x: torch.Tensor, weight: torch.Tensor, eps: float, numerics: Numerics
) -> torch.Tensor:
    """The ATen chain of a norm module with these numerics (fusionlab/numerics.py): fp32
    statistics; "llama" rounds the normalised row to x's dtype before the weight multiply."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if numerics.rounds_normed:
        h = h.to(x.dtype)
    scale = weight.to(torch.float32)
    if numerics.offset:
        scale = numerics.offset + scale
    return (scale * h).to(x.dtype)

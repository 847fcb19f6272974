"""Which modules are norms fusionlab can replace, their eps, and their numerics (casting mode and
weight offset), found by probing the module against the candidate formulas on a real input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_CANDIDATES = (("llama", 0.0), ("none", 0.0), ("gemma", 1.0), ("llama", 1.0))


@dataclass(frozen=True)
class NormInfo:
    """What a norm module computes: the fusionlab op, its eps, and how it rounds."""

    op: str
    eps: float
    casting: str = "none"  # "llama" | "gemma" | "none", or "unknown" when no formula matches
    offset: float = 0.0  # Gemma's norms multiply by (offset + weight)


def norm_op(module: nn.Module) -> str | None:
    """The op a module computes, by its class (nn.LayerNorm, nn.RMSNorm, the `RMSNorm` layer name
    of transformers' `use_kernel_forward_from_hub`, or a class named *RMSNorm / *LayerNorm with a
    1-D weight and an eps)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if isinstance(module, nn.LayerNorm):
        return "layernorm" if getattr(module, "bias", None) is not None else None
    if isinstance(module, nn.RMSNorm):
        return "rmsnorm"
    name = type(module).__name__
    if getattr(type(module), "kernel_layer_name", None) == "RMSNorm" or name.endswith("RMSNorm"):
        return "rmsnorm" if _eps_of(module) is not None else None
    if name.endswith("LayerNorm") and isinstance(getattr(module, "bias", None), torch.Tensor):
        return "layernorm" if _eps_of(module) is not None else None
    return None


def _eps_of(module: nn.Module) -> float | None:
    for attribute in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attribute, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def inspect_norm(module: nn.Module, x: torch.Tensor,
                 forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> NormInfo:
    """The module's op, eps and numerics: the candidate formula that reproduces its output on `x`
    exactly (bit for bit) wins; in float32 the castings round alike, so the class decides.
    `forward`: the module's own computation when its forward has been replaced."""
    op = norm_op(module)
    assert op is not None
    eps = _eps_of(module)
    if isinstance(module, nn.RMSNorm) and eps is None:
        eps = torch.finfo(x.dtype).eps  # what torch uses when nn.RMSNorm's eps is None
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return NormInfo(op, float(eps or 0.0))  # torch's own modules: fused, rounded once
    assert eps is not None
    with torch.no_grad():
        out = (forward or module)(x)
        if op == "layernorm":
            expected = F.layer_norm(x, (x.shape[-1],), module.weight, module.bias, eps)
            return NormInfo(op, eps, "none" if torch.equal(out, expected) else "unknown")
        for casting, offset in _CANDIDATES:  # in float32 several match: the first is kept
            if torch.equal(out, rms_norm_with(x, module.weight, eps, casting, offset)):
                return NormInfo(op, eps, casting, offset)
    return NormInfo(op, eps, "unknown")


def rms_norm_with(x: torch.Tensor, weight: torch.Tensor, eps: float, casting: str,
                  offset: float) -> torch.Tensor:
    """RMSNorm with a casting mode as Liger names them: llama rounds the normalised x to the input
    dtype before the weight multiply; gemma multiplies by (offset + weight) in float32 and rounds
    once; none computes in float32 and rounds once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        return (offset + weight) * h.to(x.dtype) if offset else weight * h.to(x.dtype)
    return (h * (offset + weight.float())).to(x.dtype)

"""Which modules are norms fusionlab can replace, their eps, and their numerics (casting mode and
weight offset), found by probing the module against the candidate formulas on a real input."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fusionlab.registry import get_op

_CANDIDATES = (("llama", 0.0), ("none", 0.0), ("gemma", 1.0), ("llama", 1.0))


@dataclass(frozen=True)
class NormInfo:
    """What a norm module computes: the fusionlab op, its eps, and how it rounds."""

    op: str
    eps: float
    casting: str = "none"  # "llama" | "gemma" | "none", or "unknown" when no formula matches
    offset: float = 0.0  # Gemma's norms multiply by (offset + weight)


@dataclass(frozen=True)
class SkippedNorm:
    """A module that looks like a norm and is not replaced, and why."""

    path: str
    module_class: str
    why: str


def unrecognised_norms(model: nn.Module) -> list[SkippedNorm]:
    """Every module of the model that looks like a norm but is not one fusionlab can replace."""
    return [
        SkippedNorm(path, type(module).__name__, why)
        for path, module in model.named_modules()
        if looks_like_norm(module) and (why := why_not_recognised(module))
    ]


def looks_like_norm(module: nn.Module) -> bool:
    """Whether a module looks like a norm: a class name with "Norm", or a 1-D weight and an eps."""
    if "Norm" in type(module).__name__:
        return True
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and _eps_of(module) is not None


def norm_op(module: nn.Module) -> str | None:
    """The op a module computes, by its class (nn.LayerNorm with or without bias, nn.RMSNorm, the
    `RMSNorm` layer name of transformers' `use_kernel_forward_from_hub`, or a class named *RMSNorm /
    *LayerNorm with a 1-D weight and an eps); None when `why_not_recognised` has a reason."""
    return None if why_not_recognised(module) else _op_by_class(module)


def why_not_recognised(module: nn.Module) -> str:
    """Why a module that looks like a norm is not one fusionlab can replace ("" when it is)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return "no weight (a norm without a learned scale is not replaced)"
    if weight.dim() != 1:
        return (f"its weight is {weight.dim()}-D {tuple(weight.shape)}; only norms over the last "
                "dim with a 1-D weight are replaced")
    op = _op_by_class(module)
    if op is None:
        return ("its class is neither nn.RMSNorm, nn.LayerNorm nor named *RMSNorm / *LayerNorm, "
                "so its formula is unknown")
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return ""
    extra = _extra_inputs(type(module).forward)
    if extra:
        return f"its forward takes more than one input ({', '.join(extra)})"
    if _eps_of(module) is None:
        return "no eps attribute (variance_epsilon, eps or epsilon)"
    bias = getattr(module, "bias", None)
    if op == "rmsnorm" and isinstance(bias, torch.Tensor):
        return "an RMSNorm with a bias: no rmsnorm variant adds one"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"its bias is a {type(bias).__name__}, not a tensor"
    return ""


def _op_by_class(module: nn.Module) -> str | None:
    return op_of_class(type(module))


def op_of_class(cls: type) -> str | None:
    """The op a norm class computes, by the class alone (see `norm_op`), or None."""
    if issubclass(cls, nn.LayerNorm):
        return "layernorm"
    if issubclass(cls, nn.RMSNorm):
        return "rmsnorm"
    name = cls.__name__
    if getattr(cls, "kernel_layer_name", None) == "RMSNorm" or name.endswith("RMSNorm"):
        return "rmsnorm"
    if name.endswith("LayerNorm"):
        return "layernorm"
    return None


def _extra_inputs(forward: Callable[..., object]) -> list[str]:
    """The inputs a forward requires besides self and the tensor it normalises."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    required = [p.name for p in parameters
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return required[1:]


def _eps_of(module: nn.Module) -> float | None:
    for attribute in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attribute, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def inspect_norm(module: nn.Module, x: torch.Tensor,
                 forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> NormInfo:
    """The module's op, eps and numerics: the candidate formula that reproduces its output on `x`
    exactly (bit for bit) wins; in float32 the castings round alike, so the class decides, and a
    formula within float32 tolerance (another reduction order) counts as "none".
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
    return numerics_of(op, out, x, module.weight, getattr(module, "bias", None), eps)


def numerics_of(op: str, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float) -> NormInfo:
    """The candidate formula that gives `out` from x bit for bit (in float32 the castings round
    alike: the first wins, and one within float32 tolerance counts as "none"), else "unknown"."""
    with torch.no_grad():
        candidates = (
            [(casting, 0.0, layer_norm_with(x, weight, bias, eps, casting))
             for casting in ("none", "llama")]
            if op == "layernorm"
            else [(casting, offset, rms_norm_with(x, weight, eps, casting, offset))
                  for casting, offset in _CANDIDATES]
        )
        for casting, offset, expected in candidates:  # in float32 several match: the first wins
            if torch.equal(out, expected):
                return NormInfo(op, eps, casting, offset)
        if x.dtype == torch.float32:
            tolerance = get_op(op).tolerance(x.dtype)
            for _, offset, expected in candidates:
                if torch.allclose(out, expected, atol=tolerance.atol, rtol=tolerance.rtol):
                    return NormInfo(op, eps, "none", offset)
    return NormInfo(op, eps, "unknown")


def layer_norm_with(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                    casting: str) -> torch.Tensor:
    """LayerNorm (bias optional) with a casting mode: none computes in float32 and rounds once
    (as Cohere's LayerNorm); llama rounds the normalised x to the input dtype first."""
    h = x.float()
    centered = h - h.mean(-1, keepdim=True)
    h = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        h = weight * h.to(x.dtype)
        return h if bias is None else h + bias
    h = h * weight.float()
    return (h if bias is None else h + bias.float()).to(x.dtype)


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

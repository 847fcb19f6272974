"""The built-in lowerings of RMSNorm: the naive ATen chain, torch.rms_norm and torch.compile."""

from __future__ import annotations

import types
from typing import Any

import torch

from fusionlab.kernels.rmsnorm.spec import RMSNORM
from fusionlab.registry import Kernel, register_variant


def naive_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The seed's chain, one ATen op at a time (16-bit inputs computed in float32, as models do)."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    variance = (h * h).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if x.dtype != torch.float32:
        h = h.to(x.dtype)
    return h * weight


def builtin_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


@register_variant(RMSNORM.name, "naive", devices=("cpu", "cuda", "neuron"))
def naive(device_type: str) -> Kernel:
    """Square, mean, add eps, rsqrt and two multiplies as separate ATen ops."""
    return naive_rmsnorm


@register_variant(RMSNORM.name, "builtin", devices=("cpu", "cuda", "neuron"))
def builtin(device_type: str) -> Kernel:
    """torch.rms_norm (aten::rms_norm, fused where the backend has a fused kernel)."""
    return builtin_rmsnorm


def _compile_rejects(
    shape: tuple[int, ...], params: dict[str, Any], device_type: str
) -> str | None:
    if device_type != "cuda" and params["mode"] != "default":
        return f"mode={params['mode']} only differs from default on CUDA"
    if device_type == "neuron" and params["dynamic"]:
        return "backend=neuron documents static shapes only"
    return None


@register_variant(
    RMSNORM.name,
    "compiled",
    devices=("cpu", "cuda", "neuron"),
    tunables={
        "mode": ("default", "max-autotune-no-cudagraphs", "reduce-overhead"),
        "dynamic": (False, True),
    },
    check_params=_compile_rejects,
)
def compiled(device_type: str, mode: str, dynamic: bool) -> Kernel:
    """torch.compile of the naive chain (inductor on cpu/cuda, the neuron backend on neuron)."""
    backend = "neuron" if device_type == "neuron" else "inductor"
    options: dict[str, Any] = {"dynamic": dynamic}
    if backend == "inductor":
        options["mode"] = mode
    # Dynamo keeps its compiled graphs, and its recompile limit, per code object: a private copy
    # of the code keeps each kernel's graphs apart, so many shapes never push one past the limit
    # into a silent eager fallback.
    private = types.FunctionType(naive_rmsnorm.__code__.replace(), naive_rmsnorm.__globals__)
    return torch.compile(private, backend=backend, **options)

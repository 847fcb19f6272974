"""The framework lowerings of add + RMSNorm: the add followed by the naive RMSNorm chain, the add
followed by torch.rms_norm, the same in place (vLLM's contract), and torch.compile."""

from __future__ import annotations

import torch

from fusionlab.kernels.add_rmsnorm.spec import ADD_RMSNORM
from fusionlab.kernels.compiling import COMPILE_TUNABLES, compile_rejects, compiled_copy
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm
from fusionlab.registry import Kernel, register_variant

_DEVICES = ("cpu", "cuda", "neuron")


def naive_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The add in float32, stored in x's dtype, then RMSNorm of the float32 sum, op by op."""
    total = x.float() + residual.float()
    out = naive_rmsnorm(total, weight.float(), eps)
    return out.to(x.dtype), total.to(x.dtype)


def builtin_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return torch.rms_norm(total, (x.shape[-1],), weight, eps), total


def builtin_add_rmsnorm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's contract: residual <- x + residual, x <- rmsnorm(residual); returns both."""
    residual.add_(x)
    x.copy_(torch.rms_norm(residual, (x.shape[-1],), weight, eps))
    return x, residual


@register_variant(ADD_RMSNORM.name, "naive", devices=_DEVICES, kind="baseline")
def naive(device_type: str) -> Kernel:
    """x + residual, then square, mean, add eps, rsqrt and two multiplies as separate ops."""
    return naive_add_rmsnorm


@register_variant(ADD_RMSNORM.name, "builtin", devices=_DEVICES, kind="builtin")
def builtin(device_type: str) -> Kernel:
    """x + residual, then torch.rms_norm."""
    return builtin_add_rmsnorm


@register_variant(
    ADD_RMSNORM.name,
    "builtin-inplace",
    devices=_DEVICES,
    kind="builtin",
    inplace={"y": "x", "residual_out": "residual"},
)
def builtin_inplace(device_type: str) -> Kernel:
    """residual.add_(x), then torch.rms_norm written back into x (in place, as vLLM does)."""
    return builtin_add_rmsnorm_


@register_variant(
    ADD_RMSNORM.name,
    "compiled",
    devices=_DEVICES,
    tunables=COMPILE_TUNABLES,
    check_params=compile_rejects,
    kind="compiled",
)
def compiled(device_type: str, mode: str, dynamic: bool) -> Kernel:
    """torch.compile of the naive chain: inductor fuses the add into the norm."""
    return compiled_copy(naive_add_rmsnorm, device_type, mode, dynamic)

"""The framework lowerings of add + RMSNorm: the add followed by the naive RMSNorm chain, the add
followed by torch.rms_norm, the same in place (vLLM's contract), and torch.compile."""

from __future__ import annotations

import torch

from fusionlab.kernels.add_rmsnorm.spec import ADD_RMSNORM
from fusionlab.kernels.common.rms_math import naive_rmsnorm, rmsnorm_with
from fusionlab.kernels.compiling import COMPILE_TUNABLES, compile_rejects, compiled_copy
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.registry import Kernel, register_variant

_DEVICES = ("cpu", "cuda", "neuron")


def naive_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The add in float32, stored in x's dtype, then RMSNorm of the float32 sum, op by op."""
    total = x.float() + residual.float()
    out = naive_rmsnorm(total, weight.float(), eps)
    return out.to(x.dtype), total.to(x.dtype)


def add_rmsnorm_with(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, numerics: Numerics
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's add and norm op by op under `numerics`: "none" normalises the fp32 sum (as the
    sweep's naive chain does); "llama" and "gemma" the sum rounded to x's dtype, as a model's
    separate `residual + hidden_states` gives it."""
    if numerics.rounds_sum:
        total = x + residual
        return rmsnorm_with(total, weight, eps, numerics), total
    total = x.float() + residual.float()
    return rmsnorm_with(total, weight, eps, numerics).to(x.dtype), total.to(x.dtype)


def chain_with(numerics: Numerics) -> Kernel:
    """add_rmsnorm_with bound to `numerics`, as a plain function torch.compile can copy."""

    def add_rmsnorm_chain(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rmsnorm_with(x, residual, weight, eps, numerics)

    return add_rmsnorm_chain


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


@register_variant(
    ADD_RMSNORM.name, "naive", devices=_DEVICES, kind="baseline", numerics=CASTING_MODES
)
def naive(device_type: str, numerics: Numerics = DEFAULT) -> Kernel:
    """x + residual, then square, mean, add eps, rsqrt and two multiplies as separate ops."""
    return naive_add_rmsnorm if numerics == DEFAULT else chain_with(numerics)


@register_variant(
    ADD_RMSNORM.name, "builtin", devices=_DEVICES, kind="builtin", numerics=("none", "gemma")
)
def builtin(device_type: str, numerics: Numerics = DEFAULT) -> Kernel:
    """x + residual, then torch.rms_norm."""
    if numerics == DEFAULT:
        return builtin_add_rmsnorm
    if numerics.rounds_normed:
        raise ValueError("builtin add_rmsnorm cannot round the normalised row (casting 'llama')")
    offset = numerics.offset

    def builtin_add_rmsnorm_offset(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum rounded to x's dtype (as "gemma" asks); an fp32 weight so torch.rms_norm
        # multiplies in fp32 and rounds once.
        total = x + residual
        return torch.rms_norm(total, (x.shape[-1],), offset + weight.to(torch.float32), eps), total

    return builtin_add_rmsnorm_offset


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
    numerics=CASTING_MODES,
)
def compiled(
    device_type: str, mode: str, dynamic: bool, numerics: Numerics = DEFAULT
) -> Kernel:
    """torch.compile of the naive chain: inductor fuses the add into the norm."""
    chain = naive_add_rmsnorm if numerics == DEFAULT else chain_with(numerics)
    return compiled_copy(chain, device_type, mode, dynamic, numerics.rounds_sum)

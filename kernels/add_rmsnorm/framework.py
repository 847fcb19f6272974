"""The framework lowerings of add + RMSNorm: the add followed by the naive RMSNorm chain, the add
followed by torch.rms_norm, the same in place (vLLM's contract), and torch.compile."""

from __future__ import annotations

import torch

from fusionlab.kernels.add_rmsnorm.spec import ADD_RMSNORM
from fusionlab.kernels.common.rms_math import naive_rmsnorm, rmsnorm_with
from fusionlab.kernels.framework_variants import DEVICES, register_framework_variants
from fusionlab.numerics import Numerics
from fusionlab.registry import Kernel, register_variant


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


def builtin_offset(numerics: Numerics) -> Kernel:
    """x + residual, then torch.rms_norm with an fp32 weight plus the offset of `numerics`."""
    offset = numerics.offset

    def builtin_add_rmsnorm_offset(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum rounded to x's dtype (as "gemma" asks); an fp32 weight so torch.rms_norm
        # multiplies in fp32 and rounds once.
        total = x + residual
        return torch.rms_norm(total, (x.shape[-1],), offset + weight.to(torch.float32), eps), total

    return builtin_add_rmsnorm_offset


def _register_builtin_inplace() -> None:
    register_variant(ADD_RMSNORM.name, "builtin-inplace", devices=DEVICES, kind="builtin",
                     inplace={"y": "x", "residual_out": "residual"},
                     description="residual.add_(x), then torch.rms_norm written back into x "
                     "(in place, as vLLM does).")(lambda device_type: builtin_add_rmsnorm_)


register_framework_variants(
    ADD_RMSNORM.name, naive_add_rmsnorm, builtin_add_rmsnorm, (
        "x + residual, then square, mean, add eps, rsqrt and two multiplies as separate ops.",
        "x + residual, then torch.rms_norm.",
        "torch.compile of the naive chain: inductor fuses the add into the norm.",
    ),
    naive_with=chain_with,
    builtin_with=builtin_offset,
    exact_casts=lambda numerics: numerics.rounds_sum,
    before_compiled=_register_builtin_inplace,
)

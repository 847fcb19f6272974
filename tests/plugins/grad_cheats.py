"""RMSNorm variants whose backward does less work than it claims, in ways the gradient gate must
catch; each forward is honest. Neither may ever pass a backward or forward+backward pass."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from fusionlab import register_variant

CPU = ("cpu",)
EXPECTED = ("cheat-cached-dweight", "cheat-previous-dx")  # each fails with incorrect or stale


def _forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    ctx.save_for_backward(x, weight, rstd)
    return (x.float() * rstd * weight.float()).to(x.dtype)


def _dx(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    x, weight, rstd = ctx.saved_tensors
    normed = x.float() * rstd
    scaled = grad.float() * weight.float()
    return (rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))).to(x.dtype)


def _dweight(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    x, weight, rstd = ctx.saved_tensors
    normed = x.float() * rstd
    return (grad.float() * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)


class _CachedWeightGrad(torch.autograd.Function):
    """dx every call; dweight once per weight tensor (by address), then the cached one."""

    cache: ClassVar[dict[int, torch.Tensor]] = {}

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _forward(ctx, x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        key = ctx.saved_tensors[1].data_ptr()
        cache = _CachedWeightGrad.cache
        if key not in cache:
            cache[key] = _dweight(ctx, grad)
        return _dx(ctx, grad), cache[key].clone(), None


class _PreviousDx(torch.autograd.Function):
    """Computes both gradients every call, but hands back the dx of the call before (as a
    pipeline that returns one step late would); the first call's own."""

    previous: ClassVar[list[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _forward(ctx, x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dx, dweight = _dx(ctx, grad), _dweight(ctx, grad)
        previous = _PreviousDx.previous
        stale = previous[0] if previous and previous[0].shape == dx.shape else dx
        previous[:] = [dx]
        return stale.clone(), dweight, None


@register_variant("rmsnorm", "cheat-cached-dweight", devices=CPU, autograd=True)
def cached_dweight(device_type: str):
    """Honest forward; a backward that reuses the weight gradient of the first call per weight."""
    _CachedWeightGrad.cache.clear()
    return _CachedWeightGrad.apply


@register_variant("rmsnorm", "cheat-previous-dx", devices=CPU, autograd=True)
def previous_dx(device_type: str):
    """Honest forward; a backward that returns the previous call's dx."""
    _PreviousDx.previous.clear()
    return _PreviousDx.apply

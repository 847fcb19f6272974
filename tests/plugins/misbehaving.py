"""Variants that misbehave on purpose: the sweep must record each and carry on."""

import os
import time

import torch

from fusionlab import register_variant


@register_variant("rmsnorm", "wrong", devices=("cpu",))
def wrong(device_type: str):
    """Fast but wrong: forgets the normalisation."""
    return lambda x, weight, eps: x * weight


@register_variant("rmsnorm", "aborts", devices=("cpu",))
def aborts(device_type: str):
    """Kills its process."""

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        os.abort()

    return kernel


@register_variant("rmsnorm", "hangs", devices=("cpu",))
def hangs(device_type: str):
    """Never returns."""

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        time.sleep(3600)
        return x

    return kernel

"""Two RMSNorm variants that compute every casting mode and pass the sweep's float64 gate, made to
differ in how they round: `stats-in-float64` sums the squares in float64 (so about one bf16
element in 1e5 rounds otherwise than a model's own module), `module-formula-slow` computes the
module's own formula and is slow on purpose, so `stats-in-float64` wins every cell."""

from __future__ import annotations

import time

import torch

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import chain_with
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics

DELAY_S = 0.005  # hundreds of times an RMSNorm of a few KiB here: no noise can reverse it


@register_variant("rmsnorm", "stats-in-float64", devices=("cpu",), numerics=CASTING_MODES)
def stats_in_float64(device_type: str, numerics: Numerics = DEFAULT):
    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        variance = x.double().pow(2).mean(-1, keepdim=True).float()
        h = x.float() * torch.rsqrt(variance + eps)
        if numerics.rounds_normed:
            h = h.to(x.dtype)
        return ((numerics.offset + weight.float()) * h).to(x.dtype)

    return kernel


@register_variant("rmsnorm", "module-formula-slow", devices=("cpu",), numerics=CASTING_MODES)
def module_formula_slow(device_type: str, numerics: Numerics = DEFAULT):
    chain = chain_with(numerics)

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        time.sleep(DELAY_S)
        return chain(x, weight, eps)

    return kernel

"""An honest, out-of-place add+RMSNorm that sleeps 3 ms per call: beside an in-place variant it
loses every time, so a sweep of the two has an in-place winner and a known out-of-place one."""

from __future__ import annotations

import time

from fusionlab import register_variant
from fusionlab.kernels.add_rmsnorm.framework import naive_add_rmsnorm


@register_variant("add_rmsnorm", "slow-naive", devices=("cpu",), kind="custom")
def slow_naive(device_type: str):
    """The naive chain after a 3 ms sleep."""

    def kernel(x, residual, weight, eps):
        time.sleep(0.003)
        return naive_add_rmsnorm(x, residual, weight, eps)

    return kernel

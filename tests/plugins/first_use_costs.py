"""Two honest RMSNorm variants whose ranking depends on what is ranked, known before measuring:
`slow-first-use` pays FUSIONLAB_TEST_FIRST_USE_S in its setup, then runs the naive chain;
`padded` runs the same chain plus a 0.5 ms sleep per call. By latency `slow-first-use` wins;
by first use + 1000 calls `padded` does (0.5 s of padding against 3 s of setup)."""

from __future__ import annotations

import os
import time

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

FIRST_USE_S = float(os.environ.get("FUSIONLAB_TEST_FIRST_USE_S", "3.0"))
PAD_S = 0.0005


@register_variant("rmsnorm", "slow-first-use", devices=("cpu",))
def slow_first_use(device_type: str):
    time.sleep(FIRST_USE_S)
    return naive_rmsnorm


@register_variant("rmsnorm", "padded", devices=("cpu",))
def padded(device_type: str):
    def kernel(x, weight, eps):
        time.sleep(PAD_S)
        return naive_rmsnorm(x, weight, eps)

    return kernel

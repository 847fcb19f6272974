"""An honest RMSNorm variant with a tunable that only changes how long its setup takes: a sweep
of it has many configurations, each slow enough that several workers overlap."""

from __future__ import annotations

import os
import time

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

SETUP_S = float(os.environ.get("FUSIONLAB_TEST_SETUP_S", "0.2"))


@register_variant(
    "rmsnorm", "slow-setup", devices=("cpu",), tunables={"copy": tuple(range(6))}, kind="custom"
)
def slow_setup(device_type: str, copy: int):
    """The naive chain after a deliberate setup delay (FUSIONLAB_TEST_SETUP_S seconds)."""
    time.sleep(SETUP_S)
    return lambda x, weight, eps: naive_rmsnorm(x, weight, eps)

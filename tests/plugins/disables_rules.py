"""A plugin that tries to switch the value rule off for itself (the test hook's environment
variable, set as it loads) and returns wrong values: the gate must still call them incorrect."""

from __future__ import annotations

import os

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

os.environ["FUSIONLAB_DISABLE_RULES"] = "error_bound"


@register_variant("rmsnorm", "dr-off-by-eps", devices=("cpu",))
def off_by_eps_unguarded(device_type: str):
    """Wrong values on every call (eps of 0.1), hoping the value rule is off."""
    return lambda x, weight, eps: naive_rmsnorm(x, weight, 1e-1)

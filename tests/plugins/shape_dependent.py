"""Two honest RMSNorm variants, each made slow on purpose at one kind of shape, so which one wins a
cell is known before anything is measured: `slow-on-few-rows` loses below 16 rows,
`slow-on-many-rows` loses from 16 rows on. A Dispatcher test checks its choice against that."""

from __future__ import annotations

import time

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

FEW_ROWS = 16
DELAY_S = 0.005  # hundreds of times an RMSNorm of a few KiB here: no noise can reverse it


def _slow_when(slow) -> object:
    def factory(device_type: str):
        def kernel(x, weight, eps):
            if slow(x.numel() // x.shape[-1]):
                time.sleep(DELAY_S)
            return naive_rmsnorm(x, weight, eps)

        return kernel

    return factory


register_variant("rmsnorm", "slow-on-few-rows", devices=("cpu",))(
    _slow_when(lambda rows: rows < FEW_ROWS)
)
register_variant("rmsnorm", "slow-on-many-rows", devices=("cpu",))(
    _slow_when(lambda rows: rows >= FEW_ROWS)
)

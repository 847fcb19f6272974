"""The NKI LayerNorm kernel's SBUF need and plan (resident x tile or streamed), in plain Python.

Resident: x read once, y written once. Streamed (the row tile does not fit next to weight and
bias): x is read three times, chunk by chunk (sum, centred sum of squares, output), which keeps
the two-pass variance exact instead of E[x^2] - mean^2. Budgets and sources: kernels/nki_common.py.
"""

from __future__ import annotations

from fusionlab.kernels.nki_common import FP32_BYTES, FREE_CHUNKS, Plan, ceil_div
from fusionlab.kernels.nki_plans import Tiling

__all__ = ["FREE_CHUNKS", "TILING", "Plan", "make_plan", "param_error", "sbuf_bytes"]


def sbuf_bytes(hidden: int, chunk: int, x_bytes: int, w_bytes: int, resident: bool) -> int:
    """Upper bound of SBUF bytes per partition the kernel holds at once."""
    weight_and_bias = 2 * hidden * w_bytes
    scratch = 2 * chunk * FP32_BYTES  # reduction-only activation output; (x - mean) * w
    stats = (2 * ceil_div(hidden, chunk) + 6) * FP32_BYTES  # partial sums, totals, -mean, rstd, eps
    x_tile = hidden * x_bytes if resident else 2 * chunk * x_bytes  # next chunk prefetched
    return weight_and_bias + scratch + stats + x_tile


TILING = Tiling(sbuf_bytes, streamed_reads=3)
make_plan = TILING.make_plan
param_error = TILING.param_error

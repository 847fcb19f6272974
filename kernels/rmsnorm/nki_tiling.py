"""The NKI RMSNorm kernel's SBUF need and plan (resident x tile or streamed), in plain Python.

The kernel (nki_kernel.py) is handed `plan.resident` and walks tiles and chunks with the same
`nki_common.span` / `program_rows` the tests check. SBUF budgets per generation and their sources
are in kernels/nki_common.py. Resident: x read once, y written once (the op's minimum traffic).
Streamed (the row tile does not fit next to the weight): x is read twice, chunk by chunk.
"""

from __future__ import annotations

from fusionlab.kernels.nki_common import FP32_BYTES, FREE_CHUNKS, Plan, ceil_div
from fusionlab.kernels.nki_plans import Tiling

__all__ = ["FREE_CHUNKS", "TILING", "Plan", "make_plan", "param_error", "sbuf_bytes"]


def sbuf_bytes(hidden: int, chunk: int, x_bytes: int, w_bytes: int, resident: bool) -> int:
    """Upper bound of SBUF bytes per partition the kernel holds at once."""
    weight = hidden * w_bytes
    squares = chunk * FP32_BYTES  # activation output that only feeds the reduction
    stats = (ceil_div(hidden, chunk) + 3) * FP32_BYTES  # per-chunk partial sums, total, rstd, eps
    x_tile = hidden * x_bytes if resident else 2 * chunk * x_bytes  # next chunk prefetched
    return weight + squares + stats + x_tile


TILING = Tiling(sbuf_bytes, streamed_reads=2)
make_plan = TILING.make_plan
param_error = TILING.param_error

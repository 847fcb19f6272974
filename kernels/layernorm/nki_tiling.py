"""The NKI LayerNorm kernel's SBUF need and plan (resident x tile or streamed), in plain Python.

Resident: x read once, y written once. Streamed (the row tile does not fit next to weight and
bias): x is read three times, chunk by chunk (sum, centred sum of squares, output), which keeps
the two-pass variance exact instead of E[x^2] - mean^2. Budgets and sources: kernels/nki_common.py.
"""

from __future__ import annotations

from fusionlab.kernels.nki_common import (
    FP32_BYTES,
    FREE_CHUNKS,
    Plan,
    budget_error,
    ceil_div,
    choose_plan,
    rows_and_hidden,
    tunable_error,
)

__all__ = ["FREE_CHUNKS", "Plan", "make_plan", "param_error", "sbuf_bytes"]


def sbuf_bytes(hidden: int, chunk: int, x_bytes: int, w_bytes: int, resident: bool) -> int:
    """Upper bound of SBUF bytes per partition the kernel holds at once."""
    weight_and_bias = 2 * hidden * w_bytes
    scratch = 2 * chunk * FP32_BYTES  # reduction-only activation output; (x - mean) * w
    stats = (2 * ceil_div(hidden, chunk) + 6) * FP32_BYTES  # partial sums, totals, -mean, rstd, eps
    x_tile = hidden * x_bytes if resident else 2 * chunk * x_bytes  # next chunk prefetched
    return weight_and_bias + scratch + stats + x_tile


def make_plan(rows: int, hidden: int, free_chunk: int, lnc_split: str, *, lnc: int, budget: int,
              x_bytes: int, w_bytes: int) -> Plan:
    """The plan for these sizes; ValueError when even the streamed plan does not fit `budget`."""
    error = param_error(rows, hidden, free_chunk, lnc_split)
    if error is not None:
        raise ValueError(error)
    return choose_plan(rows, hidden, free_chunk, lnc_split, lnc=lnc, budget=budget,
                       need=lambda c, res: sbuf_bytes(hidden, c, x_bytes, w_bytes, res),
                       streamed_reads=3)


def param_error(rows: int, hidden: int, free_chunk: int, lnc_split: str) -> str | None:
    """Why these sizes and tunables cannot run on any generation in any dtype, or None."""
    sizes = rows_and_hidden((rows, hidden))
    if isinstance(sizes, str):
        return sizes
    return tunable_error(free_chunk, lnc_split, FREE_CHUNKS) or budget_error(
        hidden, free_chunk, lambda c, res: sbuf_bytes(hidden, c, FP32_BYTES, FP32_BYTES, res))

"""The NKI RMSNorm kernel's plan: whether the x tile stays resident in SBUF, and what that costs.

Plain Python so it runs without NKI; the kernel (nki_kernel.py) is handed `plan.resident` and walks
tiles and chunks with the same `nki_common.span` / `program_rows` the tests check. SBUF budgets per
generation and their sources are in kernels/nki_common.py.

Resident (the x row tile fits next to the weight): x is read from HBM once and y written once, the
op's minimum traffic. Streamed (it does not fit): x is read twice, chunk by chunk; the plan says so
in `x_reads`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionlab.kernels.nki_common import (
    FP32_BYTES,
    MIN_SBUF_PARTITION_BYTES,
    ceil_div,
    rows_and_hidden,
    tile_partitions,
    tunable_error,
)

# Elements per instruction on the free axis. 512: many small instructions, so the store of one
# chunk overlaps the compute of the next (wins on long rows, few tiles). 8192: one instruction per
# row tile up to hidden 8192, least fixed per-instruction cost (wins with many row tiles). 2048
# sits between.
FREE_CHUNKS = (512, 2048, 8192)


@dataclass(frozen=True)
class Plan:
    """How the kernel runs one (rows, hidden, dtype) on one generation."""

    rows: int
    hidden: int
    chunk: int
    n_chunks: int
    partitions: int
    resident: bool
    sbuf_bytes: int  # per partition, the plan's upper bound (streamed chunks double-buffered)
    budget: int
    x_reads: int  # times each x element is read from HBM


def sbuf_bytes(hidden: int, chunk: int, x_bytes: int, w_bytes: int, resident: bool) -> int:
    """Upper bound of SBUF bytes per partition the kernel holds at once."""
    n_chunks = ceil_div(hidden, chunk)
    weight = hidden * w_bytes
    squares = 2 * chunk * FP32_BYTES  # activation output that only feeds the reduction
    stats = (n_chunks + 3) * FP32_BYTES  # per-chunk partial sums, total, rstd, eps
    x_tile = hidden * x_bytes if resident else 2 * chunk * x_bytes
    return weight + squares + stats + x_tile


def make_plan(
    rows: int, hidden: int, free_chunk: int, lnc_split: str, *, lnc: int, budget: int,
    x_bytes: int, w_bytes: int,
) -> Plan:
    """The plan for these sizes; ValueError when even the streamed plan does not fit `budget`."""
    error = param_error(rows, hidden, free_chunk, lnc_split)
    if error is not None:
        raise ValueError(error)
    chunk = min(free_chunk, hidden)
    resident_need = sbuf_bytes(hidden, chunk, x_bytes, w_bytes, resident=True)
    resident = resident_need <= budget
    need = resident_need if resident else sbuf_bytes(hidden, chunk, x_bytes, w_bytes, False)
    if need > budget:
        raise ValueError(f"hidden {hidden} needs {need} SBUF bytes per partition even streamed, "
                         f"over the {budget} budget")
    return Plan(rows, hidden, chunk, ceil_div(hidden, chunk), tile_partitions(rows, lnc_split, lnc),
                resident, need, budget, 1 if resident else 2)


def param_error(rows: int, hidden: int, free_chunk: int, lnc_split: str) -> str | None:
    """Why these sizes and tunables cannot run on any generation in any dtype, or None."""
    shape_error = rows_and_hidden((rows, hidden))
    if isinstance(shape_error, str):
        return shape_error
    error = tunable_error(free_chunk, lnc_split, FREE_CHUNKS)
    if error is not None:
        return error
    # Conservative: fp32 (the widest supported dtype) streamed on the smallest documented SBUF.
    need = sbuf_bytes(hidden, min(free_chunk, hidden), FP32_BYTES, FP32_BYTES, resident=False)
    if need > MIN_SBUF_PARTITION_BYTES:
        return (f"hidden {hidden} with free_chunk {free_chunk} needs {need} SBUF bytes per "
                f"partition (resident weight + streamed chunks), over the "
                f"{MIN_SBUF_PARTITION_BYTES} budget")
    return None

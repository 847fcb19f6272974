"""What the NKI kernels share about their tiling, in plain Python: a kernel's plan interface
(Tiling: its SBUF need, checks and plan) and one LNC program's walk over row tiles and free-axis
chunks (RowGrid), which the kernels call while NKI traces them. SBUF budgets and their sources
are in kernels/nki_common.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fusionlab.kernels.nki_common import (
    FP32_BYTES,
    FREE_CHUNKS,
    Plan,
    budget_error,
    ceil_div,
    choose_plan,
    program_rows,
    rows_and_hidden,
    span,
    tile_partitions,
    tunable_error,
)

# sbuf_bytes(hidden, chunk, x_bytes, w_bytes, resident): SBUF bytes per partition, upper bound.
SbufBytes = Callable[[int, int, int, int, bool], int]


@dataclass(frozen=True)
class Tiling:
    """The (rows, hidden) plan interface nki_common.shape_plan / shape_param_error expect.

    streamed_reads: how often a streamed plan reads x; resident_only: a kernel that keeps its
    fp32 row in SBUF always, so a hidden size whose row does not fit is refused."""

    sbuf_bytes: SbufBytes
    streamed_reads: int
    resident_only: bool = False

    def make_plan(self, rows: int, hidden: int, free_chunk: int, lnc_split: str, *, lnc: int,
                  budget: int, x_bytes: int, w_bytes: int) -> Plan:
        """The plan for these sizes; ValueError when no plan of this kernel fits `budget`."""
        error = self.param_error(rows, hidden, free_chunk, lnc_split)
        if error is not None:
            raise ValueError(error)
        plan = choose_plan(
            rows, hidden, free_chunk, lnc_split, lnc=lnc, budget=budget,
            need=lambda c, res: self.sbuf_bytes(hidden, c, x_bytes, w_bytes, res),
            streamed_reads=self.streamed_reads)
        if self.resident_only and not plan.resident:
            raise ValueError(f"hidden {hidden}: the fp32 sum row does not fit {budget} bytes")
        return plan

    def param_error(self, rows: int, hidden: int, free_chunk: int, lnc_split: str) -> str | None:
        """Why these sizes and tunables cannot run on any generation in any dtype, or None."""
        sizes = rows_and_hidden((rows, hidden))
        if isinstance(sizes, str):
            return sizes
        return tunable_error(free_chunk, lnc_split, FREE_CHUNKS) or budget_error(
            hidden, free_chunk,
            lambda c, res: self.sbuf_bytes(hidden, c, FP32_BYTES, FP32_BYTES, res))


@dataclass(frozen=True)
class RowGrid:
    """One LNC program's rows [first, stop), walked in tiles of `parts` partitions, and the free
    axis of `hidden` columns cut in `n_chunks` chunks of `chunk`."""

    first: int
    stop: int
    parts: int
    hidden: int
    chunk: int
    n_chunks: int

    @classmethod
    def of(cls, shape: tuple[int, int], free_chunk: int, lnc_split: str, program: int,
           programs: int) -> RowGrid:
        """The grid of LNC program `program` of `programs` over a [rows, hidden] input."""
        rows, hidden = shape
        first, stop = program_rows(rows, lnc_split, program, programs)
        chunk = min(free_chunk, hidden)
        return cls(first, stop, tile_partitions(rows, lnc_split, programs), hidden, chunk,
                   ceil_div(hidden, chunk))

    @property
    def empty(self) -> bool:
        """True when this program has no rows (lnc_split="none", or fewer rows than programs)."""
        return self.stop == self.first

    def tiles(self) -> Iterator[tuple[int, int, int]]:
        """(r0, r1, n) per row tile: partitions [0, n) hold rows [r0, r1)."""
        for t in range(ceil_div(self.stop - self.first, self.parts)):
            t0, t1 = span(t, self.parts, self.stop - self.first)
            yield self.first + t0, self.first + t1, t1 - t0

    def chunks(self) -> Iterator[tuple[int, int, int]]:
        """(c, c0, c1) per free-axis chunk: chunk c holds columns [c0, c1)."""
        for c in range(self.n_chunks):
            yield (c, *span(c, self.chunk, self.hidden))

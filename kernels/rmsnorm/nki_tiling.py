"""Tiling arithmetic of the NKI RMSNorm kernel, in plain Python so it can be tested without NKI.

The kernel (nki_kernel.py) calls `ceil_div` and `span` itself, so the loop counts and the bounds
of every tile and chunk it touches are the ones `make_plan` computes and the tests check.

Hardware numbers, from the AWS Neuron docs (SDK 2.33):
- nki/about/tiling-overview: a tile's partition dimension is at most nl.tile_size.pmax == 128;
  the last partial tile is bounded with `min(...)` slices (NKI Beta 2 removed `mask=`).
- nki/about/trainium2_arch: SBUF is 24 MiB on NeuronCore-v2 (128 partitions of 192 KiB) and
  28 MiB on NeuronCore-v3 (128 partitions of 224 KiB).
"""

from dataclasses import dataclass

PMAX = 128
# The smaller of the two documented partition sizes, so a plan that fits here fits on both cores;
# on NeuronCore-v3 the remaining 32 KiB is headroom for what the compiler reserves.
SBUF_PARTITION_BYTES = 192 * 1024
FP32_BYTES = 4
# nl.tile_size.sbuf_fmax counts a partition's free dimension in fp32 elements.
MAX_FREE_CHUNK = SBUF_PARTITION_BYTES // FP32_BYTES


def ceil_div(n: int, d: int) -> int:
    """Number of size-`d` pieces needed to cover `n` items."""
    return (n + d - 1) // d


def span(index: int, size: int, total: int) -> tuple[int, int]:
    """[start, stop) of piece `index` when `total` items are cut into pieces of `size`."""
    start = index * size
    return start, min(start + size, total)


@dataclass(frozen=True)
class RowTile:
    """Rows [start, start + valid_rows) on partitions [0, valid_rows) of one tile."""

    index: int
    start: int
    valid_rows: int

    @property
    def stop(self) -> int:
        return self.start + self.valid_rows


@dataclass(frozen=True)
class Chunk:
    """Columns [start, stop) of the hidden (free) dimension."""

    index: int
    start: int
    stop: int

    @property
    def width(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TilingPlan:
    """Row tiles on the partition dimension and chunks of the free dimension for one shape."""

    rows: int
    hidden: int
    rows_per_tile: int
    free_chunk: int
    row_tiles: tuple[RowTile, ...]
    chunks: tuple[Chunk, ...]

    @property
    def partitions(self) -> int:
        """Partitions a tile buffer needs: no more than there are rows."""
        return min(self.rows_per_tile, self.rows)

    @property
    def chunk_width(self) -> int:
        """Free-dimension width of a chunk buffer: no wider than a row."""
        return min(self.free_chunk, self.hidden)

    def row_mask(self, tile: RowTile) -> tuple[bool, ...]:
        """Which of the tile's partitions hold a row: the old `start + p < rows` mask."""
        return tuple(tile.start + p < self.rows for p in range(self.partitions))


def sbuf_bytes_per_partition(hidden: int, free_chunk: int) -> int:
    """SBUF bytes one partition needs, counting every buffer as fp32 and live at once."""
    chunk = min(free_chunk, hidden)
    resident_weight = hidden * FP32_BYTES
    # Pass 1 holds an x chunk and its squares; pass 2 an x chunk and the scaled output chunk.
    chunk_buffers = 4 * chunk * FP32_BYTES
    per_row_stats = (ceil_div(hidden, chunk) + 2) * FP32_BYTES  # chunk partial sums, total, rstd
    return resident_weight + chunk_buffers + per_row_stats


def param_error(rows: int, hidden: int, rows_per_tile: int, free_chunk: int) -> str | None:
    """Why the kernel cannot run with these sizes and tunables, or None if it can."""
    for name, value in (
        ("rows", rows),
        ("hidden", hidden),
        ("rows_per_tile", rows_per_tile),
        ("free_chunk", free_chunk),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an int, got {value!r}"
    if rows < 1:
        return f"rows must be >= 1, got {rows}"
    if hidden < 1:
        return f"hidden must be >= 1, got {hidden}"
    if not 1 <= rows_per_tile <= PMAX:
        return f"rows_per_tile must be in 1..{PMAX} (nl.tile_size.pmax), got {rows_per_tile}"
    if free_chunk < 1:
        return f"free_chunk must be >= 1, got {free_chunk}"
    if free_chunk > MAX_FREE_CHUNK:
        return (
            f"free_chunk {free_chunk} exceeds the SBUF free-dimension budget of "
            f"{MAX_FREE_CHUNK} fp32 elements per partition"
        )
    need = sbuf_bytes_per_partition(hidden, free_chunk)
    if need > SBUF_PARTITION_BYTES:
        return (
            f"hidden {hidden} with free_chunk {free_chunk} needs {need} bytes of SBUF per "
            f"partition (resident weight + chunk buffers), over the {SBUF_PARTITION_BYTES} budget"
        )
    return None


def make_plan(rows: int, hidden: int, rows_per_tile: int, free_chunk: int) -> TilingPlan:
    """The tiles and chunks the kernel walks for `rows` x `hidden`; ValueError if it cannot run."""
    error = param_error(rows, hidden, rows_per_tile, free_chunk)
    if error is not None:
        raise ValueError(error)
    row_tiles = []
    for t in range(ceil_div(rows, rows_per_tile)):
        start, stop = span(t, rows_per_tile, rows)
        row_tiles.append(RowTile(index=t, start=start, valid_rows=stop - start))
    chunk = min(free_chunk, hidden)
    chunks = tuple(Chunk(c, *span(c, chunk, hidden)) for c in range(ceil_div(hidden, chunk)))
    return TilingPlan(rows, hidden, rows_per_tile, free_chunk, tuple(row_tiles), chunks)

"""The SBUF tiles and row statistics the NKI kernels share, called from inside a kernel with that
kernel's own `nl` / `nisa` (nki.language / nki.isa as bound by nki_common.bind_language, or the
NumPy model's namespaces in kernels/nki_replay.py). A kernel's NL_NAMES / NISA_NAMES list the
names used by its own body and by every helper here that it calls (tests/test_kernel_nki.py
checks both ways), so the availability check and the NumPy model cover the helpers too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fusionlab.kernels.nki_plans import RowGrid


def chunk_tile(nl: Any, nisa: Any, grid: RowGrid, src: Any, rows: tuple[int, int, int], c0: int,
               c1: int, *, resident: Any = None, load: bool = True) -> Any:
    """Rows (r0, r1, n) and columns [c0, c1) of `src` in SBUF, on partitions [0, n): a slice of
    the `resident` row tile, else a fresh (parts, chunk) tile of src's dtype; copied from `src`
    in HBM when `load`."""
    r0, r1, n = rows
    if resident is not None:
        tile = resident[0:n, c0:c1]
    else:
        fresh = nl.ndarray((grid.parts, grid.chunk), dtype=src.dtype, buffer=nl.sbuf)
        tile = fresh[0:n, 0 : c1 - c0]
    if load:
        nisa.dma_copy(dst=tile, src=src[r0:r1, c0:c1])
    return tile


def broadcast_rows(nl: Any, nisa: Any, parts: int, *vectors: Any) -> list[Any]:
    """Each [1, hidden] vector (weight, bias) copied once onto `parts` partitions of SBUF, in its
    own dtype: loaded once per program and kept."""
    tiles = []
    for vector in vectors:
        tile = nl.ndarray((parts, vector.shape[1]), dtype=vector.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=vector.broadcast(0, parts))
        tiles.append(tile)
    return tiles


def row_total(nl: Any, nisa: Any, grid: RowGrid, partial: Any, n: int) -> Any:
    """The (P, 1) fp32 row sum of the per-chunk `partial` sums on partitions [0, n): `partial`
    itself when there is one chunk."""
    if grid.n_chunks == 1:
        return partial
    total = nl.ndarray((grid.parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=total[0:n, :], op=nl.add, data=partial[0:n, :], axis=1, keepdims=True)
    return total


def neg_mean_tile(nl: Any, nisa: Any, grid: RowGrid, sums: Any, n: int) -> Any:
    """-sum / hidden per row, a (P, 1) fp32 tile, from the per-chunk row `sums`."""
    tile = nl.ndarray((grid.parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=tile[0:n, :], data=row_total(nl, nisa, grid, sums, n)[0:n, :],
                       op0=nl.multiply, operand0=-1.0 / grid.hidden)
    return tile


def rstd_tile(nl: Any, nisa: Any, grid: RowGrid, squares: Any, eps_sb: Any, n: int) -> Any:
    """rsqrt(sum / hidden + eps) per row, a (P, 1) fp32 tile, from the per-chunk sums of
    `squares` and the (P, 1) eps tile."""
    tile = nl.ndarray((grid.parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    total = row_total(nl, nisa, grid, squares, n)
    nisa.activation(dst=tile[0:n, :], op=nl.rsqrt, data=total[0:n, :], bias=eps_sb[0:n, :],
                    scale=1.0 / grid.hidden)
    return tile


def residual_sum(nl: Any, nisa: Any, grid: RowGrid, x: Any, r: Any, res_out: Any, total_sb: Any,
                 rows: tuple[int, int, int], c0: int, c1: int) -> Any:
    """Columns [c0, c1) of x + r: kept in fp32 in the resident `total_sb` (returned, its slice)
    and stored to `res_out` in HBM rounded once to x's dtype."""
    r0, r1, n = rows
    x_c = chunk_tile(nl, nisa, grid, x, rows, c0, c1)
    r_c = chunk_tile(nl, nisa, grid, r, rows, c0, c1)
    s_c = total_sb[0:n, c0:c1]
    nisa.tensor_tensor(dst=s_c, data1=x_c, data2=r_c, op=nl.add)
    nisa.tensor_tensor(dst=r_c, data1=x_c, data2=r_c, op=nl.add)  # rounded once
    nisa.dma_copy(dst=res_out[r0:r1, c0:c1], src=r_c)
    return s_c


def row_sums(nl: Any, nisa: Any, grid: RowGrid, op: Any, chunk_of: Callable[[int, int], Any],
             rows: tuple[int, int, int], *, bias: Any = None) -> Any:
    """A (P, n_chunks) fp32 tile: column c holds, per row, the sum of op(data + bias) over chunk
    c, whose data tile chunk_of(c0, c1) gives; the elementwise results go to scratch tiles."""
    n = rows[2]
    sums = nl.ndarray((grid.parts, grid.n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    for c, c0, c1 in grid.chunks():
        data = chunk_of(c0, c1)
        scratch = nl.ndarray((grid.parts, grid.chunk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=scratch[0:n, 0 : c1 - c0], op=op, data=data, bias=bias,
                        reduce_op=nl.add, reduce_res=sums[0:n, c : c + 1],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
    return sums


def program_start(nl: Any, nisa: Any, x: Any, free_chunk: int, lnc_split: str, eps: float,
                  *vectors: Any) -> tuple[RowGrid, list[Any], Any]:
    """This LNC program's RowGrid over x [rows, hidden] (its tiles fit the partitions) and, for a
    program with rows, the [1, hidden] `vectors` on its partitions (broadcast_rows) and the eps
    tile, loaded once and kept; Nones for a program without rows."""
    grid = RowGrid.of(x.shape, free_chunk, lnc_split, nl.program_id(0), nl.num_programs(0))
    assert grid.parts <= nl.tile_size.pmax
    if grid.empty:
        return grid, [None] * len(vectors), None
    vector_tiles = broadcast_rows(nl, nisa, grid.parts, *vectors)
    return grid, vector_tiles, eps_tile(nl, nisa, grid.parts, eps)


def eps_tile(nl: Any, nisa: Any, parts: int, eps: float) -> Any:
    """eps as a (P, 1) fp32 bias tile, which every NeuronCore generation accepts (a scalar bias
    needs NeuronCore-v3): filled once per program and kept."""
    tile = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=tile, value=eps)
    return tile


def hbm_like(nl: Any, x: Any) -> Any:
    """A kernel output in shared HBM with x's shape and dtype."""
    return nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)


def resident_row(nl: Any, grid: RowGrid, dtype: Any) -> Any:
    """A (parts, hidden) SBUF tile of `dtype`: whole rows of a row tile, kept across passes."""
    return nl.ndarray((grid.parts, grid.hidden), dtype=dtype, buffer=nl.sbuf)


def store_fused(nisa: Any, out: Any, rows: tuple[int, int, int], c0: int, c1: int, tile: Any,
                **operands: Any) -> None:
    """tile = nisa.scalar_tensor_tensor(data, op0, operand0, op1, operand1) (`operands`, by
    keyword), then stored to rows (r0, r1) and columns [c0, c1) of `out` in HBM."""
    r0, r1, _ = rows
    nisa.scalar_tensor_tensor(dst=tile, **operands)
    nisa.dma_copy(dst=out[r0:r1, c0:c1], src=tile)

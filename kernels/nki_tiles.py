"""The SBUF chunk tile the NKI kernels share, called from inside a kernel with that kernel's own
`nl` / `nisa` (nki.language / nki.isa as bound by nki_common.bind_language, or the NumPy model's
namespaces in kernels/nki_replay.py). It calls only nl.ndarray, nl.sbuf and nisa.dma_copy, which
every kernel also calls itself and lists in its NL_NAMES / NISA_NAMES."""

from __future__ import annotations

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

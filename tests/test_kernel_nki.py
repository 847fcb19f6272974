"""NKI RMSNorm: the tiling plan, a NumPy emulation of the kernel's arithmetic, and the kernel.

No Trainium or Neuron SDK is needed for the plan and emulation tests; the simulator test runs only
where the real `nki` package (with nki.simulate) is installed.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from fusionlab.kernels.rmsnorm import nki_kernel, nki_tiling
from fusionlab.kernels.rmsnorm.nki_kernel import (
    TUNABLES,
    rms_norm_nki,
    simulate_rms_norm,
    simulator_unavailable_reason,
    unavailable_reason,
)
from fusionlab.kernels.rmsnorm.nki_tiling import (
    MAX_FREE_CHUNK,
    PMAX,
    SBUF_PARTITION_BYTES,
    TilingPlan,
    make_plan,
    param_error,
    sbuf_bytes_per_partition,
)

EPS = 1e-6
ROWS = (1, 127, 128, 129, 300)
HIDDENS = (1, 1000, 4096, 5000)
ROWS_PER_TILE = (1, 32, 64, 127, 128)
FREE_CHUNKS = (1, 512, 1000, 1024, 4096, 8192)


@pytest.mark.parametrize("rows_per_tile", ROWS_PER_TILE)
@pytest.mark.parametrize("rows", ROWS)
def test_row_tiles_cover_every_row_once(rows, rows_per_tile):
    plan = make_plan(rows, 8, rows_per_tile, 8)
    tiles = plan.row_tiles
    assert len(tiles) == math.ceil(rows / rows_per_tile)
    assert plan.partitions == min(rows_per_tile, rows)

    covered = np.zeros(rows, dtype=int)
    for i, tile in enumerate(tiles):
        assert tile.index == i
        assert tile.start == i * rows_per_tile
        assert 1 <= tile.valid_rows <= plan.partitions
        covered[tile.start : tile.stop] += 1
    assert (covered == 1).all()

    # Every tile but the last is full; the last holds what is left.
    assert all(t.valid_rows == rows_per_tile for t in tiles[:-1])
    assert tiles[-1].valid_rows == rows - (len(tiles) - 1) * rows_per_tile


@pytest.mark.parametrize(("rows", "rows_per_tile"), list(itertools.product(ROWS, ROWS_PER_TILE)))
def test_row_mask_marks_exactly_the_valid_partitions(rows, rows_per_tile):
    plan = make_plan(rows, 8, rows_per_tile, 8)
    for tile in plan.row_tiles:
        mask = plan.row_mask(tile)
        assert len(mask) == plan.partitions
        assert mask == tuple(p < tile.valid_rows for p in range(plan.partitions))
    assert sum(sum(plan.row_mask(t)) for t in plan.row_tiles) == rows
    partial_tiles = [t for t in plan.row_tiles if not all(plan.row_mask(t))]
    assert len(partial_tiles) == (0 if rows % plan.partitions == 0 else 1)
    if partial_tiles:
        assert partial_tiles[0] is plan.row_tiles[-1]


@pytest.mark.parametrize("free_chunk", FREE_CHUNKS)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_chunks_cover_hidden_once(hidden, free_chunk):
    if param_error(1, hidden, 1, free_chunk) is not None:
        pytest.skip("needs more SBUF than a partition has")  # e.g. 4096 one-wide chunks
    plan = make_plan(1, hidden, 1, free_chunk)
    width = min(free_chunk, hidden)
    assert plan.chunk_width == width
    assert len(plan.chunks) == math.ceil(hidden / width)

    covered = np.zeros(hidden, dtype=int)
    previous_stop = 0
    for i, chunk in enumerate(plan.chunks):
        assert chunk.index == i
        assert chunk.start == previous_stop  # contiguous, in order
        assert 1 <= chunk.width <= width
        covered[chunk.start : chunk.stop] += 1
        previous_stop = chunk.stop
    assert previous_stop == hidden
    assert (covered == 1).all()
    assert all(c.width == width for c in plan.chunks[:-1])
    assert plan.chunks[-1].width == hidden - (len(plan.chunks) - 1) * width


def test_awkward_chunk_counts():
    assert [c.width for c in make_plan(1, 5000, 1, 1024).chunks] == [1024] * 4 + [904]
    assert [c.width for c in make_plan(1, 1000, 1, 512).chunks] == [512, 488]
    assert [c.width for c in make_plan(1, 4096, 1, 4096).chunks] == [4096]
    assert [c.width for c in make_plan(1, 1, 1, 512).chunks] == [1]
    assert [t.valid_rows for t in make_plan(300, 8, 128, 8).row_tiles] == [128, 128, 44]
    assert [t.valid_rows for t in make_plan(129, 8, 128, 8).row_tiles] == [128, 1]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((0, 64, 128, 512), "rows"),
        ((4, 0, 128, 512), "hidden"),
        ((4, 64, 0, 512), "rows_per_tile"),
        ((4, 64, -3, 512), "rows_per_tile"),
        ((4, 64, PMAX + 1, 512), "rows_per_tile"),
        ((4, 64, 128, 0), "free_chunk"),
        ((4, 64, 128, MAX_FREE_CHUNK + 1), "free_chunk"),
        ((4, 50_000, 128, 512), "SBUF"),  # the resident fp32 weight alone is too big
        ((4, 32_768, 128, 4096), "SBUF"),  # weight + chunk buffers just over the budget
        ((4, 64, 128.0, 512), "int"),
        ((4, 64, True, 512), "int"),
    ],
    ids=str,
)
def test_param_error_rejects(args, fragment):
    error = param_error(*args)
    assert error is not None and fragment in error
    with pytest.raises(ValueError, match=fragment):
        make_plan(*args)


@pytest.mark.parametrize("hidden", (1, 1000, 4096, 5000, 8192, 16_384))
@pytest.mark.parametrize("rows", (1, 129, 300))
def test_param_error_accepts_every_tunable_combination(rows, hidden):
    for rows_per_tile, free_chunk in itertools.product(
        TUNABLES["rows_per_tile"], TUNABLES["free_chunk"]
    ):
        assert param_error(rows, hidden, rows_per_tile, free_chunk) is None
        assert sbuf_bytes_per_partition(hidden, free_chunk) <= SBUF_PARTITION_BYTES


def test_tunables_respect_hardware_limits():
    assert all(1 <= v <= PMAX for v in TUNABLES["rows_per_tile"])
    assert all(1 <= v <= MAX_FREE_CHUNK for v in TUNABLES["free_chunk"])


def test_kernel_uses_the_tested_arithmetic():
    assert nki_kernel.ceil_div is nki_tiling.ceil_div
    assert nki_kernel.span is nki_tiling.span
    assert nki_kernel.param_error is nki_tiling.param_error


def reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return x64 / rms * w.astype(np.float64)


def emulate(plan: TilingPlan, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The kernel's steps in NumPy: same tiles, chunks, masks and fp32 accumulation."""
    f32 = np.float32
    out = np.full(x.shape, np.nan, dtype=x.dtype)
    parts, width = plan.partitions, plan.chunk_width
    w_sb = np.broadcast_to(w.reshape(1, -1), (parts, plan.hidden)).copy()  # loaded once
    for tile in plan.row_tiles:
        mask = np.array(plan.row_mask(tile))
        rows = slice(tile.start, tile.stop)
        # Partitions past the mask hold stale data; NaN makes any leak into the output visible.
        partial = np.full((parts, len(plan.chunks)), np.nan, dtype=f32)
        for chunk in plan.chunks:
            x_sb = np.full((parts, width), np.nan, dtype=x.dtype)
            x_sb[mask, : chunk.width] = x[rows, chunk.start : chunk.stop]
            data = x_sb[:, : chunk.width].astype(f32)
            partial[:, chunk.index] = np.sum(data * data, axis=1, dtype=f32)
        total = np.sum(partial, axis=1, keepdims=True, dtype=f32)
        rstd = f32(1) / np.sqrt(total * f32(1.0 / plan.hidden) + f32(eps))
        for chunk in plan.chunks:
            x_sb = np.full((parts, width), np.nan, dtype=x.dtype)
            x_sb[mask, : chunk.width] = x[rows, chunk.start : chunk.stop]
            data = x_sb[:, : chunk.width].astype(f32)
            w_chunk = w_sb[:, chunk.start : chunk.stop].astype(f32)
            y = ((data * rstd) * w_chunk).astype(x.dtype)
            out[rows, chunk.start : chunk.stop] = y[mask]
    return out


EMULATION_CASES = [
    (rows, hidden, rows_per_tile, free_chunk)
    for rows, hidden in [(1, 1), (1, 5000), (127, 1000), (129, 4096), (300, 5000), (300, 1000)]
    for rows_per_tile, free_chunk in [(128, 4096), (32, 512), (127, 1000)]
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", EMULATION_CASES, ids=str)
def test_emulated_kernel_matches_float64_reference(case, dtype):
    rows, hidden, rows_per_tile, free_chunk = case
    rng = np.random.default_rng(rows * 7919 + hidden)
    x = (rng.standard_normal((rows, hidden)) * 3 + 0.5).astype(dtype)
    w = (rng.standard_normal(hidden) + 1.0).astype(dtype)
    assert not np.allclose(w, 1.0)

    y = emulate(make_plan(rows, hidden, rows_per_tile, free_chunk), x, w, EPS)

    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.isfinite(y).all()  # no masked-off partition reached the output
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(y.astype(np.float64), reference(x, w, EPS), rtol=tol, atol=tol)


SIMULATOR_CASES = [
    (1, 1, 128, 512),
    (129, 1000, 128, 512),
    (300, 5000, 64, 1024),
    (2, 4096, 32, 4096),
]


@pytest.mark.parametrize("case", SIMULATOR_CASES, ids=str)
def test_simulated_kernel_matches_float64_reference(case):
    reason = simulator_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    rows, hidden, rows_per_tile, free_chunk = case
    rng = np.random.default_rng(rows + hidden)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = (rng.standard_normal(hidden) + 1.0).astype(np.float32)

    y = simulate_rms_norm(x, w, EPS, rows_per_tile=rows_per_tile, free_chunk=free_chunk)

    assert y.shape == x.shape
    np.testing.assert_allclose(y.astype(np.float64), reference(x, w, EPS), rtol=1e-3, atol=1e-3)


def test_unavailable_reason_explains_itself_here():
    reason = unavailable_reason()
    assert isinstance(reason, str) and reason.strip()


def test_simulator_reason_is_none_or_text():
    reason = simulator_unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason.strip())


def test_bad_parameters_raise_before_touching_neuron():
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(ValueError, match="rows_per_tile"):
        rms_norm_nki(x, w, EPS, rows_per_tile=0, free_chunk=512)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_nki(x, torch.randn(63), EPS, rows_per_tile=32, free_chunk=512)
    with pytest.raises(ValueError, match="free_chunk"):
        simulate_rms_norm(x.numpy(), w.numpy(), EPS, rows_per_tile=32, free_chunk=0)


@pytest.mark.skipif(unavailable_reason() is None, reason="a Neuron device is present")
def test_rms_norm_nki_raises_the_reason_without_neuron():
    with pytest.raises(RuntimeError) as info:
        rms_norm_nki(torch.randn(2, 3, 64), torch.randn(64), EPS, rows_per_tile=32, free_chunk=512)
    assert str(info.value) == unavailable_reason()

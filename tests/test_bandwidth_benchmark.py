"""benchmarks/bandwidth.py's from-cache step: which cells it times again, on what shape, and how it
tells a compute-bound cell from one that memory access bounds. The lowerings are really timed
(rmsnorm's naive and built-in, small tensors); only the cell's own figures are given, set so far
apart that the verdict cannot depend on this machine's speed."""

import importlib.util
import sys
from pathlib import Path

import torch

from fusionlab.devices import resolve_device
from fusionlab.registry import get_op, variants_of

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bandwidth.py"
spec = importlib.util.spec_from_file_location("bandwidth", SCRIPT)
bandwidth = importlib.util.module_from_spec(spec)
sys.modules["bandwidth"] = bandwidth
spec.loader.exec_module(bandwidth)

SHAPE = (512, 4096)  # 8 MiB of fp32: a cell the 85% target applies to
X_BYTES = 512 * 4096 * 4


def _rounds(clone_ms: float, share: float) -> list:
    """Two rounds of a cell whose copies took clone_ms and whose built-in and naive lowerings
    reached `share` of the clone."""
    rms = get_op("rmsnorm")
    moved = rms.bytes_moved(SHAPE, torch.float32)
    clone_gbps = 2 * X_BYTES / (clone_ms * 1e-3) / 1e9
    lowering_ms = moved / (share * clone_gbps * 1e9) * 1e3
    times = {"clone": clone_ms, "copy_": clone_ms, "builtin": lowering_ms, "naive": lowering_ms}
    return [bandwidth.Round(times, variants_of("rmsnorm"), X_BYTES, moved) for _ in range(2)]


def _lines(clone_ms: float, share: float, x_bytes: int = X_BYTES) -> list[str]:
    return bandwidth.compute_bound_lines(get_op("rmsnorm"), SHAPE, "float32", resolve_device("cpu"),
                                         1, _rounds(clone_ms, share), x_bytes)


def test_the_cache_resident_shape_keeps_the_width_within_a_mebibyte():
    threads = torch.get_num_threads()
    assert bandwidth.cache_resident_shape((2048, 4096), 2) == (max(threads, 128), 4096)
    assert bandwidth.cache_resident_shape((4, 2048, 8192), 4) == (max(threads, 32), 8192)
    assert bandwidth.cache_resident_shape((1, 1 << 20), 4) == (threads, 1 << 20)


def test_a_cell_that_meets_the_target_or_is_small_is_not_timed_again():
    assert _lines(clone_ms=1.0, share=0.9) == []
    assert _lines(clone_ms=1.0, share=0.5, x_bytes=2 << 20) == []


def test_a_cell_slower_than_its_lowerings_from_cache_is_compute_bound():
    # A clone a million times faster than any real one: nothing reaches 85% of it from cache.
    (line,) = _lines(clone_ms=1e-6, share=0.5)
    assert line.startswith("512x4096 float32: from cache (") and "compute-bound here" in line
    assert "the fastest, builtin," in line or "the fastest, naive," in line


def test_a_cell_whose_lowerings_are_fast_from_cache_is_bound_by_memory_access():
    # A clone a million times slower: from cache every lowering is far above it.
    (line,) = _lines(clone_ms=1e6, share=0.5)
    assert "not compute-bound: memory access is" in line

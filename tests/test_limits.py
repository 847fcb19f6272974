"""Copy limits measured for real on the CPU, their cache, and the suspicious-result rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fusionlab.devices.cpu import cpu_llc_bytes
from fusionlab.measure.limits import (
    ROTATION_CAP_BYTES,
    SLACK,
    LimitsCache,
    _rotation,
    huge_page_clone_gbps,
    measure_copy_limits,
    size_class,
    suspicious_reason,
)
from fusionlab.records import CopyLimits


def _no_sync() -> None:
    """The CPU has nothing to wait for."""


def _limits(clone: float, copy: float) -> CopyLimits:
    return CopyLimits("cpu", "float32", 1 << 20, 20, clone, copy, False, False, 1, 1 << 25)


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_cpu_copy_limits_are_positive_and_finite(cold: bool, dtype: torch.dtype) -> None:
    limits = measure_copy_limits("cpu", dtype, 64 << 10, _no_sync, cold, cpu_llc_bytes())
    for gbps in (limits.clone_gbps, limits.copy_gbps):
        assert math.isfinite(gbps) and gbps > 0
    assert (limits.nbytes, limits.size_class, limits.dtype) == (64 << 10, 16, str(dtype)[6:])
    assert limits.cold is cold
    if cold and limits.llc_bytes is not None:
        assert limits.cold_achieved
        assert limits.buffers * limits.nbytes >= limits.llc_bytes
    if not cold:
        assert limits.buffers == 1 and not limits.cold_achieved


def test_cold_rotation_reports_when_the_cap_prevents_it() -> None:
    llc = 4 * ROTATION_CAP_BYTES  # a cache larger than the rotation may grow
    count, cold, note = _rotation(1 << 20, llc, cold=True)
    assert 2 * count * (1 << 20) <= ROTATION_CAP_BYTES
    assert not cold
    assert "capped" in note
    assert _rotation(1 << 20, 1 << 25, cold=True) == (64, True, "")


def test_llc_size_read_from_a_sysfs_tree(tmp_path: Path) -> None:
    for index, (level, kind, size) in enumerate(
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
         (3, "Unified", "96M")]
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
    assert cpu_llc_bytes(tmp_path) == 96 << 20
    assert cpu_llc_bytes(tmp_path / "missing") is None


def test_size_classes_are_power_of_two_buckets() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4096, 4097, 8191, 8192)] == [0, 1, 1, 12, 12, 12, 13]
    with pytest.raises(ValueError):
        size_class(0)


def test_cache_keeps_one_entry_per_size_class() -> None:
    cache = LimitsCache()
    first = measure_copy_limits("cpu", torch.float32, 40_000, _no_sync, cold=False, llc=None)
    cache.put(first)
    # 40 000 and 60 000 bytes share the 2^15 bucket; the cache state and dtype are keys too.
    assert cache.get("cpu", torch.float32, 60_000, cold=False) is first
    assert cache.get("cpu", "float32", 50_000, cold=False) is first
    assert cache.get("cpu", torch.float32, 40_000, cold=True) is None
    assert cache.get("cpu", torch.bfloat16, 40_000, cold=False) is None


def test_suspicious_reason_flags_a_hundredfold_figure_and_passes_half() -> None:
    limits = _limits(clone=10.0, copy=30.0)
    reason = suspicious_reason(100 * 30.0, limits)
    assert reason is not None and "100.0x" in reason
    assert suspicious_reason(0.5 * 30.0, limits) is None
    assert suspicious_reason(0.99 * SLACK * 30.0, limits) is None
    assert suspicious_reason(1.01 * SLACK * 30.0, limits) is not None


def test_huge_page_clone_gives_a_figure_or_a_reason() -> None:
    result = huge_page_clone_gbps(4 << 20, torch.float32)
    assert "subprocess failed" not in result.note, result.note  # it imports what exists
    if result.gbps is None:
        assert result.note
    else:
        assert math.isfinite(result.gbps) and result.gbps > 0
        if result.thp_mode in ("always", "madvise"):  # huge pages backed it, or it says not
            assert result.anon_huge_kb or "no huge pages" in result.note

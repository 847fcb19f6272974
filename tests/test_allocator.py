"""The host allocator is a controlled, recorded dimension of a CPU cell: set in the measuring
process's environment before it starts (--allocator fixed|default|thp), kept in the cell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import probe_sweep, run_cli
from helpers import sqlite_url

from fusionlab.measure import allocator
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage


def test_each_setting_reaches_the_measuring_process_and_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = tmp_path / "allocator.txt"
    monkeypatch.setenv("FUSIONLAB_ALLOCATOR_PROBE", str(probe))
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # the user's own: `fixed` controls it too
    url = sqlite_url(tmp_path / "allocator.db")
    expected = {
        "fixed": "MALLOC_MMAP_THRESHOLD_=134217728 MALLOC_TRIM_THRESHOLD_=536870912 "
                 "THP_MEM_ALLOC_ENABLE=-",
        "thp": "MALLOC_MMAP_THRESHOLD_=- MALLOC_TRIM_THRESHOLD_=- THP_MEM_ALLOC_ENABLE=1",
    }
    for setting, seen in expected.items():
        extra = () if setting == allocator.DEFAULT else ("--allocator", setting)
        output = probe_sweep(tmp_path, url, "allocator", *extra)
        assert f"malloc {setting}" in output
        assert set(probe.read_text().splitlines()) == {seen}
        probe.unlink()
    cells = load_cells(open_storage(url, must_exist=True), "rmsnorm")
    assert sorted(cell.cell.allocator for cell in cells) == ["fixed", "thp"]


def test_the_parent_environment_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with allocator.applied("default"):
        assert "MALLOC_TRIM_THRESHOLD_" not in os.environ
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345"
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ


def test_an_unknown_setting_is_one_clear_line(tmp_path: Path) -> None:
    result = run_cli("sweep", "rmsnorm", "--allocator", "jemalloc", cwd=tmp_path)
    assert result.returncode == 2
    assert "--allocator" in result.stderr and "Traceback" not in result.stderr

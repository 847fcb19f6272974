"""The CPU thread count is a dimension of every cell: set with --threads (default: what torch
uses), applied in the measuring process, recorded, and looked up by the Dispatcher."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import probe_sweep, run_cli
from helpers import sqlite_url

from fusionlab import Dispatcher
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_threads_are_applied_recorded_and_dispatched_on(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    probe = tmp_path / "threads.txt"
    monkeypatch.setenv("FUSIONLAB_THREADS_PROBE", str(probe))
    url = sqlite_url(tmp_path / "threads.db")
    probe_sweep(tmp_path, url, "threads", "--threads", "1")
    assert set(probe.read_text().split()) == {"1"}
    probe.unlink()
    probe_sweep(tmp_path, url, "threads", "--threads", "2")
    assert set(probe.read_text().split()) == {"2"}

    cells = load_cells(open_storage(url, must_exist=True), "rmsnorm")
    assert sorted(cell.cell.threads for cell in cells) == [1, 2]
    assert all(f"({cell.cell.threads} threads)" in cell.cell.device_label for cell in cells)

    dispatch = Dispatcher("rmsnorm", storage=url)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert dispatch.choose((4, 256), torch.float32, "cpu").match == "exact"
            unmatched = dispatch.choose((4, 128), torch.float32, "cpu")
            assert unmatched.match == "fallback" and "thread" not in unmatched.reason
        torch.set_num_threads(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            choice = dispatch.choose((4, 256), torch.float32, "cpu")
        assert choice.match == "fallback" and "1, 2 thread(s)" in choice.reason
        assert any("--threads 3" in str(w.message) for w in caught)  # a GC'd connection warns too
    finally:
        torch.set_num_threads(before)


def test_a_sweep_without_threads_uses_torchs_count(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    probe = tmp_path / "threads.txt"
    monkeypatch.setenv("FUSIONLAB_THREADS_PROBE", str(probe))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torch uses in the command
    url = sqlite_url(tmp_path / "default.db")
    probe_sweep(tmp_path, url, "threads")
    (cell,) = load_cells(open_storage(url, must_exist=True), "rmsnorm")
    assert cell.cell.threads == 1 and set(probe.read_text().split()) == {"1"}


@pytest.mark.parametrize("value", ["0", "-2"])
def test_threads_below_one_is_refused(tmp_path: Path, value: str) -> None:
    result = run_cli("sweep", "rmsnorm", "--quick", "--threads", value,
                     "--storage", sqlite_url(tmp_path / "x.db"), cwd=tmp_path)
    assert result.returncode == 2 and "--threads must be at least 1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.db").exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_workers_measure_every_configuration_once(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    probe = tmp_path / "threads.txt"
    affinity = tmp_path / "affinity.txt"
    monkeypatch.setenv("FUSIONLAB_THREADS_PROBE", str(probe))
    monkeypatch.setenv("FUSIONLAB_AFFINITY_PROBE", str(affinity))
    url = f"journal:{tmp_path / 'pinned.journal'}"
    probe_sweep(tmp_path, url, "threads", "--workers", "2", "--pin")
    (cell,) = load_cells(open_storage(url, must_exist=True), "rmsnorm")
    assert cell.cell.threads == 1
    measured = sorted(r.variant for r in cell.records)
    assert measured == ["builtin", "threads-probe"], measured
    assert set(probe.read_text().split()) == {"1"}
    # Every process below the sweep (its two workers and their measuring processes) runs on its
    # worker's own cores: two disjoint core sets, one core each here, nothing unpinned.
    here = len(os.sched_getaffinity(0))
    below = {
        frozenset(int(core) for core in cores.split(","))
        for pid, parent, cores in (line.split() for line in affinity.read_text().splitlines())
        if int(parent) != os.getpid()
    }
    assert len(below) == 2, below
    first, second = below
    assert not first & second and len(first) == len(second) == here // 2, below

"""Backward and forward+backward sweeps of the ops the rmsnorm tests do not sweep (layernorm,
add_layernorm, add_rmsnorm's pair): each produces a decided cell in its own pass, every
configuration passes the gradient gate, and the memory each configuration keeps for backward is
recorded. A few of the C++ configurations each (the backward tunable's own sweep is tested with
rmsnorm and add_rmsnorm). Real sweeps through the worker, no mocks."""

from __future__ import annotations

import pytest
from helpers import sqlite_url

from fusionlab import sweep
from fusionlab.measure.passes import BACKWARD, FORWARD_BACKWARD
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage


@pytest.mark.parametrize(("op", "pass_name"), [("layernorm", BACKWARD),
                                               ("layernorm", FORWARD_BACKWARD),
                                               ("add_layernorm", BACKWARD),
                                               ("add_layernorm", FORWARD_BACKWARD),
                                               ("add_rmsnorm", FORWARD_BACKWARD)])
def test_the_sweep_decides_a_cell_in_each_pass(op: str, pass_name: str, tmp_path) -> None:
    url = sqlite_url(tmp_path / "passes.db")
    sweep(op, "64x256", "float32", storage=url, quick=True, variants="naive,cpp",
          pass_name=pass_name, screen=False, trials=4, exhaustive_limit=1)
    (cell,) = load_cells(open_storage(url, must_exist=True, read_only=True), op)
    assert cell.cell.pass_name == pass_name and cell.verdicts, cell.cell.label
    assert all(record.passed for record in cell.records), [
        (r.variant, r.params, r.message) for r in cell.records if not r.passed]
    assert {r.variant for r in cell.records} == {"naive", "cpp"}
    assert all(r.memory is not None and r.memory.saved_bytes > 0 for r in cell.records), [
        (r.variant, r.memory) for r in cell.records]

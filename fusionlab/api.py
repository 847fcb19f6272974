"""The Python API: plan and run sweeps, and look up the winners."""

from __future__ import annotations

from typing import Any

from fusionlab.plan import make_plan
from fusionlab.registry import get_op
from fusionlab.results import CellResult
from fusionlab.search.results_store import load_cells
from fusionlab.search.runner import Progress, Sweep
from fusionlab.search.storage import DEFAULT_STORAGE, open_storage


def sweep(
    op: str,
    shapes: str | None = None,
    dtypes: str | None = None,
    *,
    device: str = "auto",
    storage: str = DEFAULT_STORAGE,
    progress: Progress | None = None,
    **options: Any,
) -> list[CellResult]:
    """Run a sweep and return its cells (also stored in `storage`)."""
    plan = make_plan(op, shapes, dtypes, device, **options)
    return Sweep(plan, open_storage(storage), progress).run()


def stored_cells(op: str, storage: str = DEFAULT_STORAGE) -> list[CellResult]:
    """Every stored cell of an op (all devices and toolchains), without measuring."""
    get_op(op)
    return load_cells(open_storage(storage, must_exist=True, read_only=True), op)

"""Stored results as export and report read them: the cells, and notes on stale toolchains."""

from __future__ import annotations

from optuna.storages import BaseStorage

from fusionlab import plan as planning
from fusionlab.devices import unavailable_reason
from fusionlab.results import CellResult
from fusionlab.schema import user_facing
from fusionlab.search.results_store import load_cells
from fusionlab.toolchain import describe_difference


def stored_cells(storage: BaseStorage, url: str, op: str) -> list[CellResult]:
    """The stored cells of an op; data this fusionlab cannot read is said in one line."""
    with user_facing(f"results in {url}"):
        return load_cells(storage, op)


def stale_notes(cells: list[CellResult], op: str) -> list[str]:
    """One line per stored toolchain that differs from the installed one."""
    notes = []
    installed = {}
    for cell in cells:
        device = cell.cell.device
        if device not in installed and unavailable_reason(device) is None:
            installed[device] = planning.installed_toolchain(op, device)
        current = installed.get(device)
        if current is not None and current != cell.cell.toolchain:
            notes.append(
                f"{cell.cell.label} on {cell.cell.device_name} was measured with another "
                f"toolchain ({describe_difference(cell.cell.toolchain, current)}); run "
                f"`fusionlab sweep {op}` to measure it with the installed one"
            )
    return sorted(set(notes))

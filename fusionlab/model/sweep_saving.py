"""A patch's predicted saving per step from the storage's sweep results alone: for each norm call
of the step, its calls times (the naive ATen chain's time - the chosen variant's time) at its
key; for a fused layer's add + norm, the add_rmsnorm / add_layernorm naive chain (the add, then
the norm) against the chosen fused variant. Nothing here runs the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage
from fusionlab.shapes import format_shape

if TYPE_CHECKING:
    from fusionlab.model.patch import PatchHandle, PatchRow

NAIVE = "naive"  # the variant that runs the op as the model's own code does: a chain of ATen ops
Times = dict[tuple[str, str], dict[str, float]]  # (op, key) -> config label -> median ms


def sweep_times(storage: str, ops: set[str], threads: int, device: str) -> Times:
    """Each forward cell's fastest median per variant configuration, at this thread count."""
    opened = open_storage(storage, must_exist=True)
    times: Times = {}
    for op in sorted(ops):
        for cell in load_cells(opened, op):
            c = cell.cell
            if c.pass_name != "forward" or c.device != device or c.threads not in (0, threads):
                continue
            labels = times.setdefault((op, f"{format_shape(c.shape)} {c.dtype}"), {})
            for record in cell.ranked("cold"):
                labels.setdefault(record.config_label(), record.latency_ms("cold") or 0.0)
                labels.setdefault(record.variant, record.latency_ms("cold") or 0.0)
    return times


def predicted_saving_ms(handle: PatchHandle, step: str, times: Times) -> tuple[float | None, str]:
    """(saving in ms of the step, "") or (None, why no honest prediction exists). Needs every
    key the step resolved in the sweep results, and the chosen variants run (rows exist)."""
    rows = {(r.path, r.key): r for r in handle.rows + [r for m in handle.modules
                                                       for r in m.late_rows]}
    fused = {f"{layer.path}.{layer.shape.norm}": {r.key: r for r in layer.add_norm.rows}
             for layer in handle.layers}
    saving = 0.0
    for call in handle.capture.calls:
        if call.step != step or call.source != "module":
            continue
        row = fused.get(call.path, {}).get(call.key)
        if row is None or row.variant == "(not fused)":
            row = rows.get((call.path, call.key))
        if row is None or row.variant.startswith("("):
            continue  # the module's own forward runs: no saving
        per_call, why = _per_call_saving(row, times)
        if per_call is None:
            return None, why
        saving += call.calls * per_call
    return saving, ""


def _per_call_saving(row: PatchRow, times: Times) -> tuple[float | None, str]:
    labels = times.get((row.op, row.key))
    if labels is None:
        return None, f"no {row.op} sweep results at {row.key} (this thread count)"
    if NAIVE not in labels:
        return None, f"the {row.op} sweep at {row.key} did not time the naive chain"
    if row.variant not in labels:
        return None, f"the {row.op} sweep at {row.key} did not time {row.variant}"
    return labels[NAIVE] - labels[row.variant], ""

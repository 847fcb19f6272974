"""A patch's predicted saving per step from the storage's sweep results alone: for each norm call
of the step, its calls times (the naive ATen chain's time - the chosen variant's time) at its
key; for a fused layer's add + norm, the add_rmsnorm / add_layernorm naive chain (the add, then
the norm) against the chosen fused variant. Nothing here runs the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusionlab.plausible import ratio_problem
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


@dataclass(frozen=True)
class Prediction:
    """A step's predicted saving, why there is none, or why a sweep figure it used is
    implausible (a naive chain beyond 100x its winner is a disturbed measurement)."""

    saving_ms: float | None
    why_none: str = ""
    problem: str = ""


def predicted_saving(handle: PatchHandle, step: str, times: Times) -> Prediction:
    """Over the step's captured module calls, each key's calls x (naive - chosen). None, with
    why, unless every key the step resolved has sweep results of both (rows exist once run)."""
    rows = {(r.path, r.key): r for r in handle.rows + [r for m in handle.modules
                                                       for r in m.late_rows]}
    fused = {f"{layer.path}.{layer.shape.norm}": {r.key: r for r in layer.add_norm.rows}
             for layer in handle.layers}
    saving, problem = 0.0, ""
    for call in handle.capture.calls:
        if call.step != step or call.source != "module":
            continue
        row = fused.get(call.path, {}).get(call.key)
        if row is None or row.variant == "(not fused)":
            row = rows.get((call.path, call.key))
        if row is None or row.variant.startswith("("):
            continue  # the module's own forward runs: no saving
        labels = times.get((row.op, row.key), {})
        why = _missing(row, labels)
        if why:
            return Prediction(None, why)
        naive, chosen = labels[NAIVE], labels[row.variant]
        problem = problem or ratio_problem(
            naive / max(chosen, 1e-12), f"the sweep's naive / {row.variant} at {row.op} {row.key}"
        )
        saving += call.calls * (naive - chosen)
    return Prediction(saving, problem=problem)


def _missing(row: PatchRow, labels: dict[str, float]) -> str:
    """Why the sweep results cannot price this row's key ("" when they can)."""
    if not labels:
        return f"no {row.op} sweep results at {row.key} at this thread count"
    if NAIVE not in labels:
        return f"the {row.op} sweep at {row.key} did not time the naive chain"
    if row.variant not in labels:
        return f"the {row.op} sweep at {row.key} did not time {row.variant}"
    return ""

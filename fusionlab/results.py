"""Results of one cell (op, device, shape, dtype) and reading them back from storage."""

from __future__ import annotations

from dataclasses import dataclass, field

from optuna.storages import BaseStorage

from fusionlab.records import TrialRecord


@dataclass
class CellResult:
    """All trial records measured for one (op, device, shape, dtype)."""

    op: str
    device_name: str
    shape: tuple[int, ...]
    dtype: str
    torch_version: str
    records: list[TrialRecord] = field(default_factory=list)
    rejected: int = 0

    def ranked(self) -> list[TrialRecord]:
        """Passing records, fastest first; failures never appear here."""
        return sorted((r for r in self.records if r.passed), key=lambda r: r.timing.median_ms)  # type: ignore[union-attr]

    def best_per_variant(self) -> dict[str, TrialRecord]:
        best: dict[str, TrialRecord] = {}
        for record in self.ranked():
            best.setdefault(record.variant, record)
        return best

    def failures(self) -> list[TrialRecord]:
        return [r for r in self.records if not r.passed]


def cell_from_trials(attrs: dict, trials: list) -> CellResult:
    """Build a CellResult from a study's user attributes and its frozen trials."""
    cell = CellResult(
        op=attrs["op"],
        device_name=attrs["device_name"],
        shape=tuple(attrs["shape"]),
        dtype=attrs["dtype"],
        torch_version=attrs.get("torch_version", ""),
    )
    for trial in trials:
        user = trial.user_attrs
        if "rejected" in user:
            cell.rejected += 1
        elif "record" in user and not user.get("duplicate"):
            cell.records.append(TrialRecord.from_dict(user["record"]))
    return cell


def load_cells(storage: BaseStorage, op: str) -> list[CellResult]:
    """Every stored cell of an op, in the order the studies were created."""
    cells = []
    for study in storage.get_all_studies():
        if study.user_attrs.get("op") != op:
            continue
        study_id = storage.get_study_id_from_name(study.study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False)
        cells.append(cell_from_trials(study.user_attrs, trials))
    return cells

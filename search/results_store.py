"""The storage format, in one place: study names, the attributes a cell and its trials carry,
and reading cells back as the schema's typed results (fusionlab/results.py). Everything else
reads and writes results through this module."""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial

from fusionlab.cell import Cell
from fusionlab.errors import UserError
from fusionlab.plan import StoredPlan
from fusionlab.records import Status, TrialRecord
from fusionlab.results import CellResult, Verdict
from fusionlab.schema import SchemaError
from fusionlab.shapes import format_shape

CELL_ATTR = "cell"
VERDICT_ATTR = "verdict"  # the re-measured decision, by rank mode: {"cold": {...}, ...}
DROPPED_ATTR = "dropped"  # contenders that failed their rounds or audit: label -> status, message
RECORD_ATTR = "record"
SUMMARY_ATTR = "measured"  # one readable line; never read back
REJECTED_ATTR = "rejected"
PLAN_ATTR = "plan"  # the sweep plan, so `fusionlab worker` can join from anywhere
_VERDICT_KEY = "verdict:"  # config keys of re-measurement claims start with this


def study_name(cell: Cell) -> str:
    """One study per cell; the toolchain id keeps other toolchains' numbers apart, and a
    backward pass's cells are apart from the forward's (whose names stay as they were)."""
    name = (
        f"{cell.op} | {cell.device_label} | toolchain {cell.toolchain_id} | "
        f"{format_shape(cell.shape)} | {cell.dtype}"
    )
    return name if cell.pass_name == "forward" else f"{name} | {cell.pass_name}"


def write_cell(study: optuna.Study, cell: Cell) -> None:
    study.set_user_attr(CELL_ATTR, cell.to_dict())


def plan_id(plan: StoredPlan) -> str:
    """A plan's identity: a hash of its variants, shapes, dtypes and settings."""
    return hashlib.sha1(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def write_plan(study: optuna.Study, plan: StoredPlan) -> None:
    """Record one more sweep plan in a cell (each plan under its own key: two sweeps planning
    the same cell at once never overwrite each other's)."""
    key = f"{PLAN_ATTR}:{plan_id(plan)}"
    if key not in study.user_attrs:
        study.set_user_attr(key, plan.to_dict())


def _plans_of(study_name: str, attrs: dict[str, Any]) -> list[StoredPlan]:
    """Every plan recorded in a cell, the older single-plan attribute included; a plan that
    does not fit the schema is a UserError naming the study and the field."""
    plans = [value for key, value in attrs.items() if key.startswith(f"{PLAN_ATTR}:")]
    plans = plans or ([attrs[PLAN_ATTR]] if PLAN_ATTR in attrs else [])
    try:
        return [StoredPlan.from_dict(plan) for plan in plans]
    except ValueError as error:  # a SchemaError, or settings out of range
        raise UserError(f"study {study_name!r}: {error}") from None


def verdict_key(mode: str, contenders: list[str]) -> str:
    """The claim key of one re-measurement of a cell's contenders."""
    return f"{_VERDICT_KEY}{mode}:{json.dumps(contenders)}"


def is_verdict_key(key: str, mode: str | None = None) -> bool:
    """Whether a claim key is a re-measurement (of that rank mode, when given)."""
    return key.startswith(_VERDICT_KEY if mode is None else f"{_VERDICT_KEY}{mode}:")


def write_metric_name(study: optuna.Study, mode: str) -> None:
    """Name the objective with its unit, as optuna-dashboard shows it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([f"{mode} median latency (ms)"])


def summary(record: TrialRecord) -> str:
    """One readable line of a trial's main measurements (the record itself is long JSON)."""
    if not record.passed:
        return f"{record.config_label()}: {record.status.value}: {record.message[:160]}"
    parts = [f"warm {record.latency_ms('warm'):.4g} ms"]
    if record.cold is not None:
        parts.insert(0, f"cold {record.cold.median_ms:.4g} ms")
    share = record.limit_share("cold")
    if share is not None:
        parts.append(f"{100 * min(share.values()):.0f}% of the copy limit")
    if record.first_use_ms is not None:
        parts.append(f"first use {record.first_use_ms:.4g} ms")
    return f"{record.config_label()}: {', '.join(parts)}"


def result_attrs(record: TrialRecord) -> dict[str, Any]:
    """The user attributes a claimed trial ends with (its config key, the `config` attr of
    search/claims.py, was written when it was enqueued): the record, and a readable summary
    for optuna-dashboard."""
    return {RECORD_ATTR: record.to_dict(), SUMMARY_ATTR: summary(record)}


def write_rejected(trial: optuna.Trial, reason: str) -> None:
    trial.set_user_attr(REJECTED_ATTR, reason)


def write_verdict(study: optuna.Study, mode: str, verdict: Verdict) -> None:
    stored = dict(study.user_attrs.get(VERDICT_ATTR, {}))
    stored[mode] = verdict.to_dict()
    study.set_user_attr(VERDICT_ATTR, stored)


def write_dropped(study: optuna.Study, dropped: dict[str, dict[str, str]]) -> None:
    """Record contenders that failed their re-measurement rounds or audit (config label ->
    status and message): loaded cells show them failed, so they never win."""
    stored = {**study.user_attrs.get(DROPPED_ATTR, {}), **dropped}
    study.set_user_attr(DROPPED_ATTR, stored)


def _apply_dropped(result: CellResult, dropped: Any) -> None:
    """A record whose contender failed the rounds or the audit takes that failure."""
    if not isinstance(dropped, dict):
        raise SchemaError(f"field {DROPPED_ATTR!r} should be an object, found {dropped!r:.40}")
    for record in result.records:
        failure = dropped.get(record.config_label())
        if failure is None or not record.passed:
            continue
        try:
            record.status = Status(failure["status"])
            record.message = f"in the re-measurement: {failure['message']}"
        except (KeyError, TypeError, ValueError):
            raise SchemaError(
                f"field {DROPPED_ATTR!r}: {record.config_label()!r} should hold a status and a "
                f"message, found {failure!r:.60}"
            ) from None


def verdicts_of(attrs: dict[str, Any]) -> dict[str, Verdict]:
    """A cell's stored verdicts by rank mode."""
    return {mode: Verdict.from_dict(data) for mode, data in attrs.get(VERDICT_ATTR, {}).items()}


def cell_from_study(attrs: dict[str, Any], trials: list[FrozenTrial]) -> CellResult | None:
    """A CellResult from a study's attributes and trials; None for a study that is not a cell.
    Data that does not fit the schema raises SchemaError, naming the trial."""
    if CELL_ATTR not in attrs:
        return None
    result = CellResult(Cell.from_dict(attrs[CELL_ATTR]), verdicts=verdicts_of(attrs))
    for trial in trials:
        user = trial.user_attrs
        if REJECTED_ATTR in user:
            result.rejected += 1
        elif RECORD_ATTR in user:
            try:
                result.records.append(TrialRecord.from_dict(user[RECORD_ATTR]))
            except SchemaError as error:
                raise SchemaError(f"trial {trial.number}: {error}") from None
    _apply_dropped(result, attrs.get(DROPPED_ATTR, {}))
    return result


def planned_cells(storage: BaseStorage) -> list[tuple[Cell, StoredPlan]]:
    """Every cell a sweep planned in this storage, once per plan that names it."""
    return [
        (Cell.from_dict(study.user_attrs[CELL_ATTR]), plan)
        for study in storage.get_all_studies()
        if CELL_ATTR in study.user_attrs
        for plan in _plans_of(study.study_name, study.user_attrs)
    ]


def load_cells(storage: BaseStorage, op: str) -> list[CellResult]:
    """Every stored cell of an op, in the order the studies were created."""
    cells = []
    for study in storage.get_all_studies():
        if study.user_attrs.get(CELL_ATTR, {}).get("op") != op:
            continue
        study_id = storage.get_study_id_from_name(study.study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False)
        try:
            result = cell_from_study(study.user_attrs, trials)
        except SchemaError as error:
            raise SchemaError(f"study {study.study_name!r}, {error}") from None
        if result is not None:
            cells.append(result)
    return cells

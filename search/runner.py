"""The Optuna-driven sweep: one study per cell, exhaustive where the space is small, TPE within a
trial budget where it is not, every measurement in an isolated worker, resumable."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna
import torch
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from fusionlab.devices import Device
from fusionlab.profiling import ProfilerSettings
from fusionlab.records import TrialRecord
from fusionlab.registry import Variant, variants_of
from fusionlab.results import CellResult, cell_from_trials
from fusionlab.search.space import CellSpace, Config, make_config
from fusionlab.shapes import format_shape
from fusionlab.timing import TimingSettings
from fusionlab.trial import TrialTask
from fusionlab.worker import TrialWorker

optuna.logging.set_verbosity(optuna.logging.WARNING)

Progress = Callable[[TrialRecord, int, int], None]


@dataclass(frozen=True)
class SweepPlan:
    """What to sweep and how; built and validated by the CLI or the Python API."""

    op: str
    device: Device
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    variants: list[str] | None = None
    trials: int = 40
    exhaustive_limit: int = 64
    fresh: bool = False
    timeout_s: float = 300.0
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    profiler: ProfilerSettings = field(default_factory=ProfilerSettings)
    plugins: list[str] = field(default_factory=list)


def study_name(op: str, device_name: str, shape: tuple[int, ...], dtype: str) -> str:
    return f"{op} | {device_name} | torch {torch.__version__} | {format_shape(shape)} | {dtype}"


def cell_variants(plan: SweepPlan, dtype: str) -> list[Variant]:
    """The variants that can run in a cell here (availability, device and dtype)."""
    chosen = variants_of(plan.op)
    if plan.variants is not None:
        chosen = {name: chosen[name] for name in plan.variants}
    return [
        v
        for v in chosen.values()
        if dtype in v.dtypes and v.unavailable_reason(plan.device.type) is None
    ]


@dataclass
class _Cell:
    plan: SweepPlan
    device_name: str
    shape: tuple[int, ...]
    dtype: str
    study: optuna.Study
    space: CellSpace
    valid: list[Config]
    finite: bool
    # The value stored for every configuration measured in this cell (None: it failed); read
    # from storage once, then kept up to date as trials end.
    done: dict[str, float | None]

    def exhaustive(self) -> bool:
        return self.finite and len(self.valid) <= self.plan.exhaustive_limit

    def pending(self) -> int:
        """How many new measurements this cell will make (an upper bound under TPE)."""
        done = len(self.done)
        if self.exhaustive():
            return max(0, len(self.valid) - done)
        return max(
            0, min(self.plan.trials, len(self.valid) if self.finite else self.plan.trials) - done
        )


class Sweep:
    """Runs a SweepPlan against a storage."""

    def __init__(
        self, plan: SweepPlan, storage: BaseStorage, progress: Progress | None = None
    ) -> None:
        self.plan = plan
        self.storage = storage
        self.progress = progress or (lambda record, index, total: None)
        self.device_name = plan.device.hardware_name()
        self.interrupted = False
        self._done = 0
        self._total = 0

    def _open_cell(self, shape: tuple[int, ...], dtype: str) -> _Cell:
        name = study_name(self.plan.op, self.device_name, shape, dtype)
        if self.plan.fresh and name in optuna.get_all_study_names(self.storage):
            optuna.delete_study(study_name=name, storage=self.storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=self.plan.seed,
                multivariate=True,
                group=True,
                n_startup_trials=max(4, self.plan.trials // 4),
            )
        study = optuna.create_study(
            storage=self.storage,
            study_name=name,
            direction="minimize",
            sampler=sampler,
            load_if_exists=True,
        )
        for key, value in {
            "op": self.plan.op,
            "device": self.plan.device.type,
            "device_name": self.device_name,
            "shape": list(shape),
            "dtype": dtype,
            "torch_version": torch.__version__,
        }.items():
            study.set_user_attr(key, value)
        variants = cell_variants(self.plan, dtype)
        valid = [
            make_config(v.name, params)
            for v in variants
            if v.is_finite()
            for params in v.configurations()
            if v.rejects(shape, params, self.plan.device.type) is None
        ]
        return _Cell(
            self.plan,
            self.device_name,
            shape,
            dtype,
            study,
            CellSpace(variants, study),
            valid,
            all(v.is_finite() for v in variants),
            {
                t.user_attrs["config"]: t.value
                for t in study.get_trials(deepcopy=False)
                if "record" in t.user_attrs and not t.user_attrs.get("duplicate")
            },
        )

    def run(self) -> list[CellResult]:
        """Measure every cell; Ctrl-C stops cleanly and keeps what was measured."""
        cells = [
            self._open_cell(shape, dtype)
            for shape in self.plan.shapes
            for dtype in self.plan.dtypes
            if cell_variants(self.plan, dtype)  # a dtype no chosen variant supports has no cell
        ]
        self._total = sum(cell.pending() for cell in cells)
        modules = sorted(
            {v.factory.__module__ for d in self.plan.dtypes for v in cell_variants(self.plan, d)}
        )
        with TrialWorker(self.plan.plugins, modules) as worker:
            try:
                for cell in cells:
                    self._run_cell(cell, worker)
            except KeyboardInterrupt:
                self.interrupted = True
        return [self._result(cell) for cell in cells]

    def _result(self, cell: _Cell) -> CellResult:
        trials = cell.study.get_trials(deepcopy=False)
        return cell_from_trials(cell.study.user_attrs, trials)

    def _run_cell(self, cell: _Cell, worker: TrialWorker) -> None:
        if cell.exhaustive():
            for config in cell.valid:
                self._measure_config(cell, worker, config)
            return
        budget = cell.pending()
        # Every variant is measured at least once (its first valid configuration) before TPE
        # spends the rest of the budget, so baselines are never left out by chance.
        first_of_each = {config.variant: config for config in reversed(cell.valid)}
        for config in list(first_of_each.values())[:budget]:
            budget -= self._measure_config(cell, worker, config)
        attempts = 0  # asks that are rejected or duplicates measure nothing and are cheap
        while budget > 0 and attempts < 50 * self.plan.trials:
            attempts += 1
            if self._step_tpe(cell, worker):
                budget -= 1

    def _measure_config(self, cell: _Cell, worker: TrialWorker, config: Config) -> bool:
        """Measure exactly this configuration unless it is stored already."""
        if config.key in cell.done:
            return False
        cell.study.enqueue_trial(cell.space.enqueue_params(config))
        trial = cell.study.ask()
        # Suggesting records the enqueued values as the trial's params, which TPE learns from.
        if cell.space.suggest(trial) != config:
            raise RuntimeError(f"Optuna did not replay the enqueued configuration {config.key}")
        self._measure(cell, worker, trial, config)
        return True

    def _step_tpe(self, cell: _Cell, worker: TrialWorker) -> bool:
        """One TPE suggestion; returns whether it led to a new measurement."""
        trial = cell.study.ask()
        config = cell.space.suggest(trial)
        variant = cell.space.variants[config.variant]
        reason = variant.rejects(cell.shape, config.as_params(), self.plan.device.type)
        if reason is not None:
            trial.set_user_attr("rejected", reason)
            cell.study.tell(trial, state=TrialState.PRUNED)
            return False
        if config.key in cell.done:
            trial.set_user_attr("duplicate", True)
            trial.set_user_attr("config", config.key)
            previous = cell.done[config.key]
            if previous is None:
                cell.study.tell(trial, state=TrialState.FAIL)
            else:
                cell.study.tell(trial, previous)
            return False
        self._measure(cell, worker, trial, config)
        return True

    def _measure(
        self, cell: _Cell, worker: TrialWorker, trial: optuna.Trial, config: Config
    ) -> None:
        task = TrialTask(
            op=self.plan.op,
            variant=config.variant,
            params=config.as_params(),
            device=self.plan.device.type,
            device_name=cell.device_name,
            shape=cell.shape,
            dtype=cell.dtype,
            seed=self.plan.seed,
            timing=self.plan.timing,
            profiler=self.plan.profiler,
        )
        try:
            record = worker.run(task, self.plan.timeout_s)
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            cell.study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("config", config.key)
        trial.set_user_attr("record", record.to_dict())
        value = record.timing.median_ms if record.passed and record.timing else None
        if value is None:
            cell.study.tell(trial, state=TrialState.FAIL)
        else:
            cell.study.tell(trial, value)
        cell.done[config.key] = value
        self._done += 1
        self.progress(record, self._done, max(self._total, self._done))

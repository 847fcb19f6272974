"""The Optuna-driven sweep: one study per cell, exhaustive where the space is small, TPE within a
trial budget where it is not, every measurement in an isolated worker, resumable; then each
cell's contenders are re-measured in interleaved rounds and the verdict is stored."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from fusionlab.cell import Cell
from fusionlab.measure.rounds import RoundsTask
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.plan import SweepPlan, valid_configs
from fusionlab.records import Status, TrialRecord
from fusionlab.report.verdict import Contender, decide
from fusionlab.report.winners import first_use_by_variant
from fusionlab.search import results_store as store
from fusionlab.search.results_store import CellResult
from fusionlab.search.space import CellSpace, Config, make_config

optuna.logging.set_verbosity(optuna.logging.WARNING)

Progress = Callable[[TrialRecord, int, int], None]
Notice = Callable[[str], None]


@dataclass
class _OpenCell:
    cell: Cell
    study: optuna.Study
    space: CellSpace
    valid: list[Config]
    finite: bool
    # The value stored for every configuration measured in this cell (None: it failed); read
    # from storage once, then kept up to date as trials end.
    done: dict[str, float | None]

    def exhaustive(self, limit: int) -> bool:
        return self.finite and len(self.valid) <= limit

    def pending(self, plan: SweepPlan) -> int:
        """How many new measurements this cell will make (an upper bound under TPE)."""
        done = len(self.done)
        if self.exhaustive(plan.exhaustive_limit):
            return max(0, len(self.valid) - done)
        return max(0, min(plan.trials, len(self.valid) if self.finite else plan.trials) - done)


class Sweep:
    """Runs a SweepPlan against a storage."""

    def __init__(
        self,
        plan: SweepPlan,
        storage: BaseStorage,
        progress: Progress | None = None,
        notice: Notice | None = None,
    ) -> None:
        self.plan = plan
        self.storage = storage
        self.progress = progress or (lambda record, index, total: None)
        self.notice = notice or (lambda text: None)
        self.interrupted = False
        self._done = 0
        self._total = 0

    def _open_cell(self, cell: Cell) -> _OpenCell:
        name = store.study_name(cell)
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
        store.write_cell(study, cell)
        variants = self.plan.cell_variants(cell.dtype)
        valid = [
            make_config(v.name, params)
            for v in variants
            if v.is_finite()
            for params in valid_configs(v, cell.shape, cell.device)
        ]
        trials = study.get_trials(deepcopy=False)
        return _OpenCell(
            cell,
            study,
            CellSpace(variants, study),
            valid,
            all(v.is_finite() for v in variants),
            store.measured_configs(trials),
        )

    def run(self) -> list[CellResult]:
        """Measure every cell; Ctrl-C stops cleanly and keeps what was measured."""
        cells = [self._open_cell(cell) for cell in self.plan.cells()]
        self._total = sum(cell.pending(self.plan) for cell in cells)
        modules = sorted(
            {v.factory.__module__ for d in self.plan.dtypes for v in self.plan.cell_variants(d)}
        )
        with TrialWorker(self.plan.plugins, modules) as worker:
            try:
                for cell in cells:
                    self._search(cell, worker)
                    self._confirm(cell, worker)
            except KeyboardInterrupt:
                self.interrupted = True
        return [self._result(cell) for cell in cells]

    def _result(self, cell: _OpenCell) -> CellResult:
        study = cell.study
        result = store.cell_from_study(study.user_attrs, study.get_trials(deepcopy=False))
        assert result is not None
        return result

    def _search(self, cell: _OpenCell, worker: TrialWorker) -> None:
        if cell.exhaustive(self.plan.exhaustive_limit):
            for config in cell.valid:
                self._measure_config(cell, worker, config)
            return
        budget = cell.pending(self.plan)
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

    def _measure_config(self, cell: _OpenCell, worker: TrialWorker, config: Config) -> bool:
        """Measure exactly this configuration unless it is stored already."""
        if config.key in cell.done:
            return False
        cell.study.enqueue_trial(
            cell.space.enqueue_params(config), user_attrs=store.planned_attrs(config.key)
        )
        trial = cell.study.ask()
        # Suggesting records the enqueued values as the trial's params, which TPE learns from.
        if cell.space.suggest(trial) != config:
            raise RuntimeError(f"Optuna did not replay the enqueued configuration {config.key}")
        self._measure(cell, worker, trial, config, planned=True)
        return True

    def _step_tpe(self, cell: _OpenCell, worker: TrialWorker) -> bool:
        """One TPE suggestion; returns whether it led to a new measurement."""
        trial = cell.study.ask()
        config = cell.space.suggest(trial)
        variant = cell.space.variants[config.variant]
        reason = variant.rejects(cell.cell.shape, config.as_params(), self.plan.device.type)
        if reason is not None:
            store.write_rejected(trial, reason)
            cell.study.tell(trial, state=TrialState.PRUNED)
            return False
        if config.key in cell.done:
            store.write_duplicate(trial, config.key)
            previous = cell.done[config.key]
            if previous is None:
                cell.study.tell(trial, state=TrialState.FAIL)
            else:
                cell.study.tell(trial, previous)
            return False
        self._measure(cell, worker, trial, config)
        return True

    def _measure(
        self,
        cell: _OpenCell,
        worker: TrialWorker,
        trial: optuna.Trial,
        config: Config,
        planned: bool = False,
    ) -> None:
        task = TrialTask(
            cell=cell.cell,
            variant=config.variant,
            params=config.as_params(),
            seed=self.plan.seed,
            timing=self.plan.timing,
            profiler=self.plan.profiler,
        )
        try:
            record = TrialRecord.from_dict(worker.run(task, self.plan.timeout_s))
        except KeyboardInterrupt:
            store.write_interrupted(trial)
            cell.study.tell(trial, state=TrialState.FAIL)
            raise
        store.write_result(trial, config.key, record, planned)
        value = record.latency_ms(self.plan.rank_by) if record.passed else None
        if value is None:
            cell.study.tell(trial, state=TrialState.FAIL)
        else:
            cell.study.tell(trial, value)
        cell.done[config.key] = value
        self._done += 1
        self.progress(record, self._done, max(self._total, self._done))

    def _confirm(self, cell: _OpenCell, worker: TrialWorker) -> None:
        """Re-measure the contenders in interleaved rounds; store the verdict with its interval."""
        confirm, mode = self.plan.confirm, self.plan.rank_by
        if confirm is None:
            return
        result = self._result(cell)
        best = result.best_per_variant(mode)
        if not best:
            return
        ordered = list(best.values())
        fastest = ordered[0].latency_ms(mode) or 0.0
        chosen = [
            r
            for index, r in enumerate(ordered)
            if index < confirm.min_contenders
            or (r.latency_ms(mode) or float("inf")) <= fastest * (1 + confirm.within)
        ]
        labels = [r.config_label() for r in chosen]
        stored = result.verdicts.get(mode)
        if stored is not None and stored.get("contenders") == labels:
            return
        task = RoundsTask(
            cell=cell.cell,
            contenders=[(r.config_label(), r.variant, dict(r.params)) for r in chosen],
            mode=mode,
            rounds=confirm.rounds if len(chosen) > 1 else 0,
            seed=self.plan.seed,
            timing=confirm.timing,
        )
        self.notice(f"{cell.cell.label}: re-measuring {', '.join(labels)} in interleaved rounds")
        outcome = worker.run(task, self.plan.timeout_s * max(len(chosen), 1))
        variants = cell.space.variants
        first_use = first_use_by_variant(result)
        contenders = []
        for record in chosen:
            entry = outcome[record.config_label()]
            if entry["status"] != Status.PASSED.value or (task.rounds and not entry["rounds"]):
                self.notice(
                    f"  {record.config_label()} dropped: {entry['status']}: {entry['message']}"
                )
                continue
            rounds = entry["rounds"] or [record.timing_for(mode).samples_ms]  # type: ignore[union-attr]
            contenders.append(
                Contender(
                    name=record.config_label(),
                    kind=variants[record.variant].kind,
                    first_use_ms=first_use.get(record.variant),
                    rounds=rounds,
                )
            )
        if contenders:
            verdict = decide(contenders).to_dict()
            verdict["contenders"] = labels
            store.write_verdict(cell.study, mode, verdict)

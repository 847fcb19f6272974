"""The Optuna-driven sweep: one study per cell, exhaustive where the space is small, TPE within a
trial budget where it is not, every measurement in an isolated worker process, resumable; then
each cell's contenders are re-measured in interleaved rounds and the verdict is stored.

Every measurement goes through a claim (search/claims.py), so any number of these runners, in
any processes or hosts, can work on one storage: each configuration, and each cell's
re-measurement, is done exactly once, by whichever runner claims it first."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.storages import BaseStorage

from fusionlab.cell import Cell
from fusionlab.measure import disturbance, stalls
from fusionlab.measure.rounds import (
    ContenderRounds,
    RoundsReply,
    RoundsSummary,
    RoundsTask,
    StopRule,
)
from fusionlab.measure.screen import Screen, bar_for
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.plan import StoredPlan, SweepPlan, valid_configs
from fusionlab.records import BusyWindow, TrialRecord
from fusionlab.results import OUTCOMES, CellResult, Verdict
from fusionlab.search import claims
from fusionlab.search import results_store as store
from fusionlab.search.space import CellSpace, make_config
from fusionlab.verdict import Contender, decide, implausible, paired_ratio
from fusionlab.winners import first_use_by_variant

optuna.logging.set_verbosity(optuna.logging.WARNING)

Progress = Callable[[TrialRecord, int, int], None]
Notice = Callable[[str], None]
Starting = Callable[[Cell, str, dict[str, object]], None]  # cell, variant (or task), params

_TPE_ATTEMPTS = 50  # proposals per budgeted trial before a cell gives up (rejected, duplicates)
_POLL_S = 1.0  # how often a runner looks again while other runners hold a cell's last claims


def _versus_winner(
    winner: str,
    contenders: list[Contender],
    outcome: dict[str, ContenderRounds],
    baselines: list[TrialRecord],
) -> dict[str, list[float]]:
    """Each baseline over the winner, [ratio, low, high], from the rounds both were measured in;
    a baseline without every round (it failed, or no rounds ran) gets no ratio."""
    by_name = {c.name: c for c in contenders}
    mine = by_name[winner]
    paired = {}
    for record in baselines:
        label = record.config_label()
        entry = outcome.get(label)
        if label == winner or entry is None or not entry.passed:
            continue
        rounds = by_name[label].rounds if label in by_name else entry.rounds
        if len(rounds) == len(mine.rounds) and all(rounds):
            paired[label] = paired_ratio(mine, Contender(label, "", None, rounds))
    return paired


def _describe_rounds(verdict: Verdict, rounds: RoundsSummary, rule: StopRule) -> None:
    """How the rounds went, into the verdict: their figures, and in its reason what disturbed
    them and what a busy machine made implausible."""
    verdict.rounds = rounds.stored()
    verdict.rounds["from_disturbed"] = bool(rounds.disturbed) and rounds.quiet < rule.min_rounds
    if rounds.disturbed:
        verdict.reason += (
            f"; {rounds.disturbed} of {rounds.run} rounds were disturbed by other processes, "
            f"each measured again while the budget lasted (stopped: {rounds.stopped})"
        )
    if problem := implausible(verdict):
        verdict.reason += f"; {problem}: a disturbed measurement, shown marked"


def lease_from_env() -> claims.Lease:
    """The claim lease: FUSIONLAB_LEASE_S seconds (default 120), renewed every quarter of it."""
    seconds = float(os.environ.get("FUSIONLAB_LEASE_S", claims.Lease.seconds))
    return claims.Lease(seconds=seconds, renew_s=seconds / 4)


def measured_count(study: optuna.Study) -> int:
    """Configurations measured in a cell so far, by any runner (re-measurements not counted)."""
    return sum(not store.is_verdict_key(key) for key in claims.done_keys(study))


@dataclass
class _OpenCell:
    cell: Cell
    study: optuna.Study
    space: CellSpace
    exhaustive: bool
    budget: int  # configurations to measure in all, whoever measures them
    planned: list[tuple[str, dict[str, object]]]  # enqueued up front (re-planned if lost)
    attempts: int = 0

    def measured(self) -> int:
        return measured_count(self.study)


class Sweep:
    """Runs a SweepPlan against a storage, alone or beside other runners."""

    def __init__(
        self,
        plan: SweepPlan,
        storage: BaseStorage,
        progress: Progress | None = None,
        notice: Notice | None = None,
        lease: claims.Lease | None = None,
        spread: bool = False,
        starting: Starting | None = None,
        cell_done: Callable[[Cell], None] | None = None,
    ) -> None:
        """`spread`: plan and claim configurations from a random start (for workers started
        together); without it one runner measures them in the plan's order. `starting` hears of
        each measurement before it runs, `cell_done` of each cell left with nothing to do."""
        self.plan = plan
        self.storage = storage
        self.progress = progress or (lambda record, index, total: None)
        self.notice = notice or (lambda text: None)
        self.lease = lease or lease_from_env()
        self.spread = spread
        self.starting = starting or (lambda cell, variant, params: None)
        self.cell_done = cell_done or (lambda cell: None)
        self.me = claims.worker_name()
        self.interrupted = False
        self.measured_here: list[str] = []
        self.builds_s: dict[str, float] = {}  # C++ extension -> its build, once per sweep
        self.search_s = 0.0  # wall time of this runner's measurements of configurations
        self.confirm_s = 0.0  # and of its interleaved re-measurements
        self.audit_s = 0.0  # the part of confirm_s spent auditing contenders
        self.screen_s = 0.0  # and of its brief screening measurements
        self.screened = 0  # configurations screened here
        self.screen_saved = 0  # full measurements the screen made unnecessary
        self.confirmed_here = 0
        self.extra_rounds = 0  # rounds beyond the minimum, because a cell was not decided yet
        self.extra_rounds_s = 0.0
        # (cell label, what other processes did) for each timed window
        self.windows: list[tuple[str, BusyWindow]] = []
        self.stalled: list[str] = []  # configurations whose samples show a barrier stall
        self._cells: list[_OpenCell] = []

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
                constant_liar=True,  # other runners' RUNNING claims steer proposals away
            )
        study = optuna.create_study(
            storage=self.storage,
            study_name=name,
            direction="minimize",
            sampler=sampler,
            load_if_exists=True,
        )
        if store.CELL_ATTR not in study.user_attrs:
            store.write_cell(study, cell)
            store.write_metric_name(study, self.plan.rank_by)
        store.write_plan(study, StoredPlan.of(self.plan))  # every plan of the cell
        variants = self.plan.cell_variants(cell.dtype)
        valid = [
            make_config(v.name, params)
            for v in variants
            if v.is_finite()
            for params in valid_configs(v, cell.shape, cell.device)
        ]
        finite = all(v.is_finite() for v in variants)
        exhaustive = finite and len(valid) <= self.plan.exhaustive_limit
        budget = len(valid) if exhaustive else self.plan.trials
        if finite:
            budget = min(budget, len(valid))
        if exhaustive:
            chosen = valid
        else:
            # Every variant is measured at least once (its first valid configuration) before TPE
            # spends the rest of the budget, so baselines are never left out by chance.
            chosen = list({c.variant: c for c in reversed(valid)}.values())[:budget]
        space = CellSpace(variants, study)
        planned = [(c.key, space.enqueue_params(c)) for c in chosen]
        claims.plan_cell(study, planned, self.spread)
        return _OpenCell(cell, study, space, exhaustive, budget, planned)

    def open(self) -> None:
        """Create every cell's study and enqueue its configurations (idempotent, race-safe)."""
        if not self._cells:
            self._cells = [self._open_cell(cell) for cell in self.plan.cells()]

    def run(self) -> list[CellResult]:
        """Work until every cell is done by someone; Ctrl-C stops cleanly and keeps what was
        measured (a claim held at that moment goes back to the storage for the next runner)."""
        self.open()
        modules = sorted(
            {v.factory.__module__ for d in self.plan.dtypes for v in self.plan.cell_variants(d)}
        )
        with TrialWorker(
            self.plan.plugins, modules, self.plan.threads, self.plan.allocator
        ) as worker:
            try:
                pending = list(self._cells)
                while pending:
                    pending = [cell for cell in pending if not self._advance(cell, worker)]
                    if pending:
                        time.sleep(_POLL_S)
            except KeyboardInterrupt:
                self.interrupted = True
        return self.results()

    def planned(self) -> tuple[int, int]:
        """Configurations measured so far by any runner, and to measure in all."""
        self.open()
        done = sum(c.measured() for c in self._cells)
        return done, max(sum(c.budget for c in self._cells), done)

    def results(self) -> list[CellResult]:
        return [self._result(cell) for cell in self._cells]

    def _result(self, cell: _OpenCell) -> CellResult:
        study = cell.study
        result = store.cell_from_study(study.user_attrs, study.get_trials(deepcopy=False))
        assert result is not None
        return result.only(self.plan.variants)  # another plan's variants are not ours

    def _advance(self, cell: _OpenCell, worker: TrialWorker) -> bool:
        """Measure what this cell has left to claim; True once nothing is left for anyone."""
        while True:
            claim = claims.claim_next(
                cell.study,
                self.me,
                self.lease,
                lambda key: self._can_measure(cell, key),
                spread=self.spread,
            )
            if claim is not None:
                with claim:
                    self._work(cell, claim, worker)
                continue
            if self._propose(cell):
                continue
            if claims.anything_running(cell.study):
                return False  # another runner holds a claim here; look again later
            # A taker-over that died between its PRUNED and its enqueue left a configuration
            # with no live trial: planning again brings it back.
            if claims.plan_cell(cell.study, cell.planned, self.spread):
                continue
            key = self._verdict_key(cell)
            if key is None or not claims.plan_cell(cell.study, [(key, {})], self.spread):
                self.cell_done(cell.cell)
                return True

    def _can_measure(self, cell: _OpenCell, key: str) -> bool:
        """Whether a waiting configuration is one of this plan's (another plan of the same
        cell may name other variants)."""
        if store.is_verdict_key(key):
            return store.is_verdict_key(key, self.plan.rank_by)
        config = json.loads(key)
        variant = cell.space.variants.get(config["variant"])
        return variant is not None and (
            variant.rejects(cell.cell.shape, config["params"], self.plan.device.type) is None
        )

    def _propose(self, cell: _OpenCell) -> bool:
        """One TPE proposal while the budget lasts; True if one was made."""
        if cell.exhaustive or cell.attempts >= _TPE_ATTEMPTS * self.plan.trials:
            return False
        if cell.measured() >= cell.budget:
            return False
        cell.attempts += 1
        claims.propose(cell.study, lambda trial: self._suggest(cell, trial))
        return True

    def _suggest(self, cell: _OpenCell, trial: optuna.Trial) -> tuple[str, dict] | None:
        config = cell.space.suggest(trial)
        variant = cell.space.variants[config.variant]
        reason = variant.rejects(cell.cell.shape, config.as_params(), self.plan.device.type)
        if reason is not None:
            store.write_rejected(trial, reason)
            return None
        return config.key, cell.space.enqueue_params(config)

    def _work(self, cell: _OpenCell, claim: claims.Claim, worker: TrialWorker) -> None:
        if store.is_verdict_key(claim.key):
            self._confirm(cell, claim, worker)
            return
        # Replaying records the enqueued values as the trial's params, which TPE learns from.
        config = cell.space.replay(claim.trial, claim.key)
        screen = self._screen(cell, config.variant)
        task = TrialTask(
            cell=cell.cell,
            variant=config.variant,
            params=config.as_params(),
            seed=self.plan.seed,
            timing=self.plan.timing,
            profiler=self.plan.profiler,
            screen=screen,
        )
        self.starting(cell.cell, config.variant, dict(task.params))
        start = time.perf_counter()
        record = TrialRecord.from_dict(worker.run(task, self.plan.timeout_s))
        seconds = time.perf_counter() - start
        self.screened += screen is not None
        if record.passed and record.message.startswith("screened out"):
            self.screen_saved += 1
            self.screen_s += seconds
        else:
            self.search_s += seconds
        if record.disturbance is not None:
            self.windows.append((cell.cell.label, record.disturbance))
        for name, build_s in record.builds_s.items():  # a wait for another's build is shorter
            self.builds_s[name] = max(self.builds_s.get(name, 0.0), build_s)
        if record.passed and stalls.stalled(record):
            self.stalled.append(f"{cell.cell.label} {record.config_label()}")
        value = record.latency_ms(self.plan.rank_by) if record.passed else None
        if claim.finish(value, store.result_attrs(record)):
            self.measured_here.append(claim.key)
            self.progress(record, *self.planned())

    def _screen(self, cell: _OpenCell, variant: str) -> Screen | None:
        """The screen a configuration of `variant` must pass before its full measurement: None
        while the variant has no full measurement in the cell (every variant keeps one) or
        when the plan does not screen."""
        if not self.plan.screen:
            return None
        full = [r for r in self._result(cell).records if r.passed and r.cold is not None]
        if not any(r.variant == variant for r in full):
            return None
        return bar_for(min(r.latency_ms("warm") or float("inf") for r in full))

    def _contenders(self, result: CellResult) -> list[TrialRecord]:
        """The best configuration of every variant within `within` of the fastest (at least
        `min_contenders`)."""
        confirm, mode = self.plan.confirm, self.plan.rank_by
        assert confirm is not None
        ordered = list(result.best_per_variant(mode).values())
        if not ordered:
            return []
        fastest = ordered[0].latency_ms(mode) or 0.0
        return [
            r
            for index, r in enumerate(ordered)
            if index < confirm.min_contenders
            or (r.latency_ms(mode) or float("inf")) <= fastest * (1 + confirm.within)
        ]

    def _baselines(self, result: CellResult) -> list[TrialRecord]:
        """The best configuration of the op's baseline and of its built-in, where measured."""
        spec = self.plan.spec
        best = result.best_per_variant(self.plan.rank_by)
        return [best[name] for name in dict.fromkeys((spec.baseline, spec.builtin))
                if name in best]

    def _references(self, result: CellResult, labels: list[str]) -> list[TrialRecord]:
        """The baselines that are not contenders: measured in the same rounds, deciding nothing,
        so that every ratio against them is paired."""
        return [r for r in self._baselines(result) if r.config_label() not in labels]

    def _verdict_key(self, cell: _OpenCell) -> str | None:
        """The re-measurement this cell still needs, or None when its verdict is stored."""
        if self.plan.confirm is None:
            return None
        result = self._result(cell)
        labels = [r.config_label() for r in self._contenders(result)]
        stored = result.verdicts.get(self.plan.rank_by)
        if not labels or (stored is not None and stored.contenders == labels):
            return None
        return store.verdict_key(self.plan.rank_by, labels)

    def _confirm(self, cell: _OpenCell, claim: claims.Claim, worker: TrialWorker) -> None:
        """Re-measure the contenders in interleaved rounds until the data decides or the cell's
        budget is spent; store the verdict with its interval and how the rounds went."""
        confirm, mode = self.plan.confirm, self.plan.rank_by
        assert confirm is not None
        result = self._result(cell)
        chosen = self._contenders(result)
        labels = [r.config_label() for r in chosen]
        if store.verdict_key(mode, labels) != claim.key:
            claim.close("the contenders changed meanwhile")
            return
        stored = result.verdicts.get(mode)
        if stored is not None and stored.contenders == labels:  # a twin decided it
            claim.close("decided already")
            return
        # A lone contender gets no rounds, but its audit all the same.
        rule = confirm.rule if len(chosen) > 1 else StopRule(min_rounds=0, max_rounds=0)
        task = self._rounds_task(cell, chosen, self._references(result, labels), rule)
        self.notice(f"{cell.cell.label}: re-measuring {', '.join(labels)} in interleaved rounds")
        self.starting(cell.cell, "re-measuring", {"contenders": len(chosen)})
        start = time.perf_counter()
        reply = worker.run(task, self.plan.timeout_s * len(chosen) + confirm.rule.budget_s)
        self.confirm_s += time.perf_counter() - start
        self._count_rounds(cell, reply, rule)
        contenders, dropped = self._survivors(cell, result, chosen, reply)
        if dropped:  # a failed contender never wins: the cell is decided again without it
            store.write_dropped(cell.study, dropped)
        if not contenders:
            claim.finish(None)  # every contender failed its rounds or audit: a failed measurement
            return
        verdict = decide(contenders)
        verdict.contenders = labels
        verdict.versus_winner = _versus_winner(verdict.winner, contenders, reply.contenders,
                                               self._baselines(result))
        _describe_rounds(verdict, reply.rounds, rule)
        store.write_verdict(cell.study, mode, verdict)
        claim.close(f"re-measured: {verdict.decision}")

    def _rounds_task(
        self, cell: _OpenCell, chosen: list[TrialRecord], references: list[TrialRecord],
        rule: StopRule,
    ) -> RoundsTask:
        """The contenders and the references not among them, timed in the same rounds."""
        confirm, mode = self.plan.confirm, self.plan.rank_by
        assert confirm is not None
        return RoundsTask(
            cell=cell.cell,
            contenders=[(r.config_label(), r.variant, dict(r.params))
                        for r in chosen + references],
            mode=mode,
            rule=rule,
            seed=self.plan.seed,
            timing=confirm.timing,
            decided_ms={r.config_label(): r.latency_ms(mode) or 0.0 for r in chosen},
            references=tuple(r.config_label() for r in references),
        )

    def _count_rounds(self, cell: _OpenCell, reply: RoundsReply, rule: StopRule) -> None:
        """This runner's tally of a cell's rounds: audits, disturbed windows, extra rounds."""
        rounds = reply.rounds
        self.confirmed_here += 1
        self.audit_s += sum(outcome.audit_s for outcome in reply.contenders.values())
        self.windows.extend((cell.cell.label, w.window()) for w in rounds.windows if w)
        extra = max(0, rounds.run - rule.min_rounds)
        self.extra_rounds += extra
        if rounds.run:
            self.extra_rounds_s += extra / rounds.run * rounds.elapsed_s

    def _survivors(
        self, cell: _OpenCell, result: CellResult, chosen: list[TrialRecord], reply: RoundsReply
    ) -> tuple[list[Contender], dict[str, dict[str, str]]]:
        """The contenders that passed their rounds and audit, and the failed ones with why."""
        mode, variants = self.plan.rank_by, cell.space.variants
        first_use = first_use_by_variant(result)
        contenders, dropped = [], {}
        for record in chosen:
            label = record.config_label()
            outcome = reply.contenders.get(label, ContenderRounds())
            if not outcome.passed or (reply.rounds.run and not outcome.rounds):
                self.notice(f"  {label} dropped: {outcome.status.value}: {outcome.message}")
                if not outcome.passed:
                    dropped[label] = {"status": outcome.status.value, "message": outcome.message}
                continue
            samples = record.timing_for(mode).samples_ms  # type: ignore[union-attr]
            contenders.append(
                Contender(
                    name=label,
                    kind=variants[record.variant].kind,
                    first_use_ms=first_use.get(record.variant),
                    rounds=outcome.rounds or [samples],
                )
            )
        return contenders, dropped

    def closing_line(self) -> str | None:
        """What this runner measured, what the re-measurement and its extra rounds cost, and how
        the cells ended; None when nothing was measured here."""
        if not self.measured_here:
            return None
        full = len(self.measured_here) - self.screen_saved
        line = f"measured {full} configurations in {self.search_s:.1f} s"
        if self.screened:
            line += (
                f" (the screen ruled out {self.screen_saved} of {self.screened} screened, "
                f"{self.screen_s:.1f} s: {self.screen_saved} full measurements saved)"
            )
        if self.confirmed_here and self.plan.confirm is not None:
            rule = self.plan.confirm.rule
            line += (
                f"; re-measuring {self.confirmed_here} cells took {self.confirm_s:.1f} s more "
                f"(+{100 * self.confirm_s / max(self.search_s, 1e-9):.0f}%), "
                f"{self.extra_rounds_s:.1f} s of it in {self.extra_rounds} rounds beyond the "
                f"first {rule.min_rounds} of a cell (budget {rule.budget_s:g} s a cell), "
                f"{self.audit_s:.1f} s in the audit of "
                f"every contender (+{100 * self.audit_s / max(self.search_s, 1e-9):.0f}% of the "
                "search)"
            )
        if self.builds_s:
            line += "; C++ builds (once for the sweep, in no cell's first use): " + ", ".join(
                f"{name} {seconds:.1f} s" for name, seconds in sorted(self.builds_s.items())
            )
        decisions = Counter(
            verdict.decision
            for result in self.results()
            if (verdict := result.verdicts.get(self.plan.rank_by)) is not None
        )
        if decisions:
            line += "; cells: " + ", ".join(
                f"{decisions[name]} {name}"
                for name in OUTCOMES
                if decisions[name]
            )
        return line

    def stall_warning(self) -> str | None:
        """One line naming the configurations a barrier stall slowed, with the remedy."""
        return stalls.stall_line(self.stalled, self.plan.threads) if self.stalled else None

    def busy_warning(self) -> str | None:
        """One line with the figure when other processes disturbed this runner's timings."""
        touched = [label for label, seen in self.windows if seen.disturbed]
        return disturbance.summary([seen for _, seen in self.windows], touched)

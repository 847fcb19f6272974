"""The Optuna runner on real studies: TPE within a budget for a large space, rejected values
never measured, duplicates never measured twice, and a second run adds nothing."""

import re
import time
from pathlib import Path

import optuna
import optuna.distributions as od
import torch
from conftest import cpu_cell
from helpers import QUICK_TIMING as FAST
from helpers import sqlite_url

from fusionlab import register_variant, sweep
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm
from fusionlab.measure.screen import BRIEF, bar_for
from fusionlab.measure.timing import time_calls
from fusionlab.plan import make_plan
from fusionlab.records import Status, TrialRecord
from fusionlab.registry import variants_of
from fusionlab.search.results_store import is_verdict_key, study_name
from fusionlab.search.runner import Sweep
from fusionlab.search.space import CellSpace, make_config
from fusionlab.search.storage import open_storage


def _odd_unroll_is_invalid(shape, params, device_type):
    return "odd unroll" if params["unroll"] % 2 else None


@register_variant("rmsnorm", "test-big-space", devices=("cpu",),
                  tunables={"unroll": od.IntDistribution(1, 400), "scale": (1, 2)},
                  check_params=_odd_unroll_is_invalid)
def big_space(device_type: str, unroll: int, scale: int):
    return naive_rmsnorm


def test_tpe_budget_rejections_and_resume(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "tpe.db")
    options = {"variants": ["naive", "test-big-space"], "trials": 7, "timing": FAST, "seed": 1}
    cells = sweep("rmsnorm", "2x32", "float32", device="cpu", storage=url, **options)
    (cell,) = cells
    assert len(cell.records) == 7  # the budget is new measurements
    assert [r.variant for r in cell.records].count("naive") == 1  # every variant runs once
    big = [r for r in cell.records if r.variant == "test-big-space"]
    assert all(r.params["unroll"] % 2 == 0 for r in big)
    assert len({(r.params["unroll"], r.params["scale"]) for r in big}) == 6
    study = optuna.load_study(study_name=study_name(cell.cell), storage=url)
    rejected = [t for t in study.trials if "rejected" in t.user_attrs]
    assert cell.rejected == len(rejected)
    assert all(t.params["test-big-space.unroll"] % 2 for t in rejected)

    again = sweep("rmsnorm", "2x32", "float32", device="cpu", storage=url, **options)
    assert len(again[0].records) == 7


def test_exhaustive_cell_measures_every_valid_config_once(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "grid.db")
    (cell,) = sweep("rmsnorm", "2x32", "float32", device="cpu", storage=url,
                    variants=["naive", "compiled"], timing=FAST)
    configs = sorted((r.variant, tuple(sorted(r.params.items()))) for r in cell.records)
    assert configs == [
        ("compiled", (("dynamic", False), ("mode", "default"))),
        ("compiled", (("dynamic", True), ("mode", "default"))),
        ("naive", ()),
    ]
    assert all(r.passed for r in cell.records)


def test_enqueued_trials_record_their_params(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "params.db")
    (cell,) = sweep("rmsnorm", "2x32", "float32", device="cpu", storage=url,
                    variants=["naive"], timing=FAST)
    study = optuna.load_study(study_name=study_name(cell.cell), storage=url)
    measured = [t for t in study.trials if not is_verdict_key(t.user_attrs["config"])]
    assert [t.params for t in measured] == [{"variant": "naive"}]


def _repeated(repeat: int):
    def kernel(x, weight, eps):
        for _ in range(repeat - 1):
            torch.rms_norm(x, (x.shape[-1],), weight, eps)
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)

    return kernel


@register_variant("rmsnorm", "test-repeat", devices=("cpu",), tunables={"repeat": (1, 200)})
def repeat_rmsnorm(device_type: str, repeat: int):
    """torch.rms_norm computed `repeat` times: the same answer, `repeat` times the work."""
    return _repeated(repeat)


@register_variant("rmsnorm", "test-repeat-slow-first", devices=("cpu",),
                  tunables={"repeat": (200, 1)})
def repeat_slow_first(device_type: str, repeat: int):
    """As test-repeat, with the slow configuration planned first."""
    return _repeated(repeat)


def test_the_screen_measures_in_full_only_what_can_still_win(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "screen.db")
    (cell,) = sweep("rmsnorm", "64x1024", "float32", device="cpu", storage=url,
                    variants=["builtin", "test-repeat", "test-repeat-slow-first"], timing=FAST)
    by_variant = {(r.variant, r.params.get("repeat")): r for r in cell.records}
    # The first configuration of every variant is measured in full, whatever it costs.
    assert by_variant[("test-repeat", 1)].cold is not None
    assert by_variant[("test-repeat-slow-first", 200)].cold is not None
    # 200x the work of the fastest: ruled out by the brief timing, which the record keeps.
    slow = by_variant[("test-repeat", 200)]
    assert slow.passed and slow.cold is None and slow.timing is not None
    assert slow.message.startswith("screened out: brief warm median")
    # A later configuration that can win is measured in full.
    fast = by_variant[("test-repeat-slow-first", 1)]
    assert fast.cold is not None and not fast.message
    best = cell.best_per_variant("cold")
    assert best["test-repeat"].params == {"repeat": 1}
    assert best["test-repeat-slow-first"].params == {"repeat": 1}


def test_without_the_screen_every_configuration_is_measured_in_full(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "full.db")
    (cell,) = sweep("rmsnorm", "64x1024", "float32", device="cpu", storage=url,
                    variants=["builtin", "test-repeat"], timing=FAST, screen=False)
    assert all(r.cold is not None and not r.message for r in cell.records)


def test_the_closing_line_counts_outcomes_and_what_the_rounds_cost(tmp_path: Path) -> None:
    plan = make_plan("rmsnorm", "64x1024", "float32", "cpu", variants=["naive", "builtin"],
                     timing=FAST)
    runner = Sweep(plan, open_storage(sqlite_url(tmp_path / "line.db")))
    (cell,) = runner.run()
    decision = cell.verdicts["cold"].decision
    assert decision in {"faster", "equivalent", "inconclusive"}
    rounds = cell.verdicts["cold"].rounds
    assert rounds["run"] >= 5 and rounds["stopped"] in {"decided", "settled", "budget"}
    line = runner.closing_line()
    assert re.fullmatch(
        r"measured 2 configurations in [\d.]+ s; re-measuring 1 cells took [\d.]+ s more "
        r"\(\+\d+%\), [\d.]+ s of it in \d+ rounds beyond the first 5 of a cell \(budget 3 s a "
        r"cell\), [\d.]+ s in the audit of every contender \(\+\d+% of the search\); "
        rf"cells: 1 {decision}", line or ""), line


def test_an_enqueued_trial_replays_its_own_configuration_whoever_bound_the_names(
        tmp_path: Path) -> None:
    """Two sweeps of one cell with other variants: a worker that binds its parameter names after
    the other plan's first trial (so its `variant` name is suffixed) still measures exactly the
    configuration its planner enqueued under the plain name (before: Optuna sampled another)."""
    variants = variants_of("rmsnorm")
    ours = [variants[name] for name in ("builtin", "naive", "compiled", "cpp")]
    study = optuna.create_study(storage=sqlite_url(tmp_path / "cell.db"))
    planner = CellSpace(ours, study)  # bound while the study is empty: plain names
    other = CellSpace([variants["naive"]], study)
    first = study.ask()
    other.suggest(first)  # the other plan's `variant`, with its own choices, comes first
    study.tell(first, 1.0)
    config = make_config("builtin", {})
    study.enqueue_trial(planner.enqueue_params(config))
    worker = CellSpace(ours, study)  # bound now: `variant` is taken, so its name is suffixed
    assert worker.enqueue_params(config) != planner.enqueue_params(config)
    assert worker.replay(study.ask(), config.key) == config


def _brief_timings(pauses_s: list[float]):
    """Brief timings of torch.rms_norm on real tensors; the i-th timing's calls each also wait
    pauses_s[i] (a burst of noise), later ones none."""
    x, weight = torch.randn(16, 1024), torch.randn(1024)
    pauses = iter(pauses_s)

    def time_brief():
        pause = next(pauses, 0.0)

        def call(index: int) -> torch.Tensor:
            if pause:
                time.sleep(pause)
            return torch.rms_norm(x, (1024,), weight, 1e-6)

        return time_calls(call, 1, lambda: None, BRIEF).timing, None

    return time_brief


def test_one_slow_brief_timing_does_not_rule_out_what_can_win() -> None:
    """Noise only slows a timing: a brief timing above the bar is taken again and the faster
    kept, so a configuration slowed by one burst is still measured in full; one slow every
    time is ruled out."""
    full_ms = min(_brief_timings([])()[0].median_ms for _ in range(3))
    screen = bar_for(full_ms * 4)  # 6x the fastest unpaused median: room for noise
    burst = TrialRecord(cpu_cell("rmsnorm", (64, 1024)), "builtin", {}, Status.PASSED)
    assert not screen.rules_out(_brief_timings([0.01]), burst)
    assert burst.timing is None and not burst.message
    slow = TrialRecord(cpu_cell("rmsnorm", (64, 1024)), "builtin", {}, Status.PASSED)
    assert screen.rules_out(_brief_timings([0.01, 0.01]), slow)
    assert slow.timing is not None and slow.timing.median_ms > 10
    assert slow.message.startswith("screened out: brief warm median")

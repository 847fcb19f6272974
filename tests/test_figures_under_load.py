"""Every figure a table shows is measured undisturbed or marked: paired ratios against the
baselines, `!` after a figure from a disturbed window, `~` and fewer digits where the noise is
large; and a real sweep beside a CPU hog, whose every output keeps to that."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_cell, run_cli
from helpers import sqlite_url

from fusionlab.records import BusyWindow, Status, Timing, TrialRecord
from fusionlab.report import export
from fusionlab.report.tables import ROUND_FIGURES, SEARCH_FIGURES, best_row, display_rows
from fusionlab.results import CellResult, Decision, Verdict, WinnersFile, classify
from fusionlab.verdict import implausible


def _timing(latency_ms: float, spread: float) -> Timing:
    samples = [latency_ms * (1 + spread * (i - 5) / 5) for i in range(11)]
    return Timing(latency_ms, latency_ms * (1 - spread / 2), latency_ms * (1 + spread / 2),
                  min(samples), spread, 1, samples)


def _record(variant: str, latency_ms: float, spread: float = 0.01,
            busy: bool = False) -> TrialRecord:
    record = TrialRecord(cpu_cell("rmsnorm", (4, 64)), variant, {}, Status.PASSED, setup_ms=0.0,
                         first_call_ms=0.1, timing=_timing(latency_ms, spread),
                         cold=_timing(latency_ms, spread), bytes_moved=4 * 64 * 8)
    if busy:
        record.disturbance = BusyWindow(wall_s=0.1, other_cpu_s=0.12, other_share=0.6, load=3.0,
                                        mhz=None, disturbed=True, attempts=3)
    return record


def _verdict(rounds: dict, versus_winner: dict) -> Verdict:
    return Verdict(
        ranking=["builtin", "naive"], latency_ms={"builtin": 0.01, "naive": 0.03},
        winner="builtin", runner_up="naive", ratio=3.0, ci_low=2.8, ci_high=3.2,
        decision=Decision.FASTER, equivalent_group=["builtin"], reason="builtin faster",
        confidence=0.95, threshold=0.03, resamples=2000, seed=0, contenders=["builtin", "naive"],
        rounds=rounds, versus_winner=versus_winner)


def test_baseline_ratios_come_from_the_rounds_or_are_omitted() -> None:
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)), [_record("builtin", 0.01),
                                                       _record("naive", 0.5)])
    row = best_row(cell)  # no verdict: search medians only, so no ratio at all
    assert row.speedup_vs_baseline is None and row.ratio is None
    assert row.speedup_vs_builtin == 1.0  # the winner is the built-in itself
    shown = display_rows([row], "rmsnorm")[0]
    assert shown["vs naive"] == "-" and shown["runner-up/winner [95% CI]"] == "-"
    cell.verdicts["cold"] = _verdict({"run": 5, "disturbed": 0}, {"naive": [3.0, 2.9, 3.1]})
    row = best_row(cell)  # paired in the rounds: 3x, not the 50x of the two search medians
    assert (row.speedup_vs_baseline, row.speedup_vs_baseline_ci) == (3.0, [2.9, 3.1])
    assert display_rows([row], "rmsnorm")[0]["vs naive"] == "3.00x [2.90, 3.10]"


def test_disturbed_and_noisy_figures_are_marked_in_every_format() -> None:
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)), [_record("builtin", 0.0123456, 0.4, True),
                                                       _record("naive", 0.5)])
    cell.verdicts["cold"] = _verdict({"run": 5, "disturbed": 4, "from_disturbed": True},
                                     {"naive": [3.0, 2.9, 3.1]})
    row = best_row(cell)
    assert set(row.disturbed) == set(SEARCH_FIGURES) | set(ROUND_FIGURES)
    assert {"median_ms", "warm_ms", "cold_ms", "gbps"} <= set(row.noisy)
    winners = WinnersFile("rmsnorm", [row], ranked_by="cold")
    typed = json.loads(export.render(winners, "json"))["rows"][0]
    assert set(typed["disturbed"]) == set(row.disturbed) and typed["noisy"] == row.noisy
    table = next(csv.DictReader(io.StringIO(export.render(winners, "csv"))))
    assert table["median ms"] == "~0.012!"  # two digits the noise supports, then busy
    assert table["vs naive"] == "3.00x [2.90, 3.10]!" and table["decision"] == "faster!"
    assert table["IQR %"] == "40.0!" and table["fastest"] == "builtin"
    for fmt in ("md", "latex", "html"):
        text = export.render(winners, fmt)
        rough = "\\textasciitilde{}0.012!" if fmt == "latex" else "~0.012!"
        assert rough in text and "3.00x [2.90, 3.10]!" in text, fmt
    chosen = json.loads(export.render(winners, "json", "median_ms,decided"))["rows"][0]
    assert chosen == {"median_ms": "~0.012!", "decided": "faster 3.00x [2.80, 3.20]!"}


def test_quiet_figures_carry_no_mark() -> None:
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)), [_record("builtin", 0.0123456),
                                                       _record("naive", 0.5)])
    cell.verdicts["cold"] = _verdict({"run": 7, "disturbed": 2, "from_disturbed": False},
                                     {"naive": [3.0, 2.9, 3.1]})
    row = best_row(cell)
    assert row.disturbed == [] and row.noisy == []
    text = export.render(WinnersFile("rmsnorm", [row]), "md")
    assert "0.0123" in text and "!" not in text and "~" not in text


def test_a_ratio_no_device_could_show_is_marked_even_from_quiet_rounds() -> None:
    """Two lowerings of one norm move the same bytes: 2075x between them is a disturbed
    measurement, marked like one although the rounds were not flagged disturbed."""
    cell = CellResult(cpu_cell("rmsnorm", (4, 64)), [_record("builtin", 0.0123456),
                                                       _record("naive", 0.5)])
    cell.verdicts["cold"] = _verdict({"run": 7, "disturbed": 0, "from_disturbed": False},
                                     {"naive": [2075.29, 1900.0, 2200.0]})
    assert "naive over builtin 2075x is beyond 100x" in implausible(cell.verdicts["cold"])
    row = best_row(cell)
    assert set(row.disturbed) == set(ROUND_FIGURES)
    shown = display_rows([row], "rmsnorm")[0]
    assert shown["vs naive"] == "2075.29x [1900.00, 2200.00]!"
    cell.verdicts["cold"].versus_winner = {"naive": [3.0, 2.9, 3.1]}
    assert implausible(cell.verdicts["cold"]) == "" and best_row(cell).disturbed == []


@pytest.fixture
def hog():
    """Two busy processes, one per core of a 2-core machine, beside the sweep."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for process in spin:
        process.kill()
        process.wait()


def test_a_sweep_beside_a_hog_marks_every_disturbed_figure(hog, tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "r.db")
    result = run_cli("sweep", "rmsnorm", "--quick", "--shapes", "8x1024", "--variants",
                     "naive,builtin", "--device", "cpu", "--storage", url, "--export",
                     "rows.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads((tmp_path / "rows.json").read_text())["rows"]
    shown = run_cli("export", "rmsnorm", "--storage", url, "--format", "csv", cwd=tmp_path)
    (text,) = list(csv.DictReader(io.StringIO(shown.stdout)))
    from fusionlab.api import stored_cells

    (cell,) = stored_cells("rmsnorm", url)
    verdict = cell.verdicts["cold"]
    winner = cell.record_of(verdict.winner)
    # Whatever the hog left disturbed is marked, in the typed field and in the text.
    search_busy = winner.disturbance is not None and winner.disturbance.disturbed
    rounds_busy = bool(verdict.rounds.get("from_disturbed"))
    assert set(row["disturbed"]) == (set(SEARCH_FIGURES) if search_busy else set()) | (
        set(ROUND_FIGURES) if rounds_busy else set())
    assert text["median ms"].endswith("!") == search_busy
    assert text["decision"].endswith("!") == rounds_busy
    if search_busy or rounds_busy:
        assert "measured while other processes used more than a quarter" in result.stdout
    if search_busy:  # re-measured before it was kept disturbed
        assert winner.disturbance is not None and winner.disturbance.attempts == 3
    # Every ratio agrees with the row's decision interval, from the same rounds.
    assert row["ci_low"] <= row["ratio"] <= row["ci_high"]
    assert classify(row["ci_low"], row["ci_high"], verdict.threshold).value == row["decision"]
    for key in ("speedup_vs_baseline", "speedup_vs_builtin"):
        if row[f"{key}_ci"] is not None:
            low, high = row[f"{key}_ci"]
            assert low <= row[key] <= high
        else:
            assert row[key] == 1.0  # the winner itself

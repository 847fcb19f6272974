"""A damaged journal (a record cut short by a crash mid-write, or garbage after the last
record) is set aside with a backup and a warning, the rest is read, and the sweep resumes:
nothing is ever appended onto a broken line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage

SWEEP = ("sweep", "rmsnorm", "--quick", "--shapes", "4x256", "--variants", "builtin,naive")


def _measured(url: str) -> list[str]:
    (cell,) = load_cells(open_storage(url, must_exist=True), "rmsnorm")
    return sorted(record.config_label() for record in cell.records)


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """One sweep's whole journal and what it measured, shared by the damages below."""
    folder = tmp_path_factory.mktemp("intact")
    journal = folder / "results.journal"
    first = run_cli(*SWEEP, "--storage", f"journal:{journal}", cwd=folder)
    assert first.returncode == 0, first.stderr[-2000:]
    return journal.read_text(), _measured(f"journal:{journal}")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[:-15], id="cut-last-line"),
        pytest.param(lambda text: text + "\x00\x00garbage}\n", id="garbage-last-line"),
    ],
)
def test_a_damaged_journal_tail_is_set_aside_and_the_sweep_resumes(
        tmp_path: Path, intact: tuple[str, list[str]], damage) -> None:
    whole, before = intact
    journal = tmp_path / "results.journal"
    url = f"journal:{journal}"
    journal.write_text(damage(whole))

    again = run_cli(*SWEEP, "--storage", url, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Traceback" not in again.stderr
    assert "ended in a damaged record" in again.stderr
    (backup,) = tmp_path.glob("results.journal.damaged-*")
    assert backup.read_text() == damage(whole)  # the whole damaged file, kept as it was
    # Every line of the journal is whole JSON again: nothing was appended onto a broken line.
    for line in journal.read_text().splitlines():
        json.loads(line)
    assert _measured(url) == before
    status = run_cli("status", "--storage", url, cwd=tmp_path)
    assert status.returncode == 0, status.stderr

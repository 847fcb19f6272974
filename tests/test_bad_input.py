"""Every bad input is refused the same way, by every command and the Python API: one line that
says what to fix, exit code 2 (or a ValueError/TypeError/UserError in Python), nothing written.
The commands run in this process through `fusionlab.cli.main`, as the `fusionlab` script does."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import optuna
import pytest
import torch
from helpers import sqlite_url

from fusionlab import Dispatcher, api, cli
from fusionlab.errors import UserError

FOREIGN_DB = "foreign.db"  # an SQLite file of someone else's, with a table of its own
FOREIGN_JOURNAL = "notes.txt"  # a text file that is no journal
OPTUNA_DB = "optuna.db"  # a real (empty) Optuna storage: no sweep planned in it
UNWRITABLE = "/proc/fusionlab-export.json"  # a folder that exists, where no file can be made


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    with sqlite3.connect(tmp_path / FOREIGN_DB) as db:
        db.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
        db.execute("INSERT INTO invoices VALUES (1, 9.5)")
    (tmp_path / FOREIGN_JOURNAL).write_text("shopping list\nmilk\n")
    optuna.create_study(storage=sqlite_url(tmp_path / OPTUNA_DB), study_name="unrelated")
    return tmp_path


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


SWEEP = ("sweep", "rmsnorm", "--quick", "--variants", "builtin")
PROFILE = ("profile", "add_rmsnorm", "--shape", "4x256", "--variant")
CASES = {
    # sweep
    "superscript digit in a shape": ([*SWEEP, "--shapes", "\u00b2x4096"], "does not parse"),
    "upper-case X in a shape": ([*SWEEP, "--shapes", "4X4096"], "lower-case 'x'"),
    "timeout nan": ([*SWEEP, "--timeout", "nan"], "--timeout must be greater than 0"),
    "timeout inf": ([*SWEEP, "--timeout", "inf"], "--timeout must be at most"),
    "timeout 1e300": ([*SWEEP, "--timeout", "1e300"], "--timeout must be at most"),
    "seed beyond 64 bits": ([*SWEEP, "--seed", str(2**64)], "--seed must be an integer"),
    "negative seed": ([*SWEEP, "--seed", "-1"], "--seed must be an integer"),
    "sweep export path not writable": ([*SWEEP, "--export", UNWRITABLE], "cannot write"),
    "sweep --calls 0": ([*SWEEP, "--calls", "0"], "--calls must be greater than 0"),
    "sweep unknown column": ([*SWEEP, "--columns", "shape,nosuchcolumn"],
                             "unknown column nosuchcolumn"),
    "sweep more threads than CPUs": ([*SWEEP, "--threads", "100000"],
                                     "pass --threads"),
    "capture more threads than CPUs": (["capture", "--model", "llama-tiny", "--threads",
                                        "100000"], "more than this machine can run at once"),
    # compare and profile
    "compare superscript shape": (["compare", "rmsnorm", "--shape", "4x\u00b2"], "does not parse"),
    "compare timeout inf": (["compare", "rmsnorm", "--shape", "4x256", "--timeout", "inf"],
                            "--timeout must be at most"),
    "profile param abc": ([*PROFILE, "cpp", "--param", "rows_per_task=abc"], "choose one of 1, 4"),
    "profile param list": ([*PROFILE, "cpp", "--param", "rows_per_task=[1]"], "choose one of"),
    "profile param 2.5": ([*PROFILE, "cpp", "--param", "rows_per_task=2.5"], "choose one of"),
    "profile param off-list": ([*PROFILE, "cpp", "--param", "rows_per_task=3"], "choose one of"),
    "profile param True for an int": ([*PROFILE, "cpp", "--param", "rows_per_task=True"],
                                      "choose one of"),
    "profile dynamic=maybe": ([*PROFILE, "compiled", "--param", "dynamic=maybe"],
                              "choose one of False, True"),
    "profile seed beyond 64 bits": ([*PROFILE, "cpp", "--seed", str(2**70)], "--seed must be"),
    # export
    "export --calls -5": (["export", "rmsnorm", "--calls", "-5", "--storage",
                           sqlite_url(OPTUNA_DB)], "--calls must be at least 1"),
    "export into a foreign SQLite file": (["export", "rmsnorm", "--storage",
                                           sqlite_url(FOREIGN_DB)], "not an Optuna storage"),
    "export from a file that is no journal": (["export", "rmsnorm", "--storage",
                                               f"journal:{FOREIGN_JOURNAL}"],
                                              "not an Optuna storage"),
    "export path not writable": (["export", "rmsnorm", "--storage", sqlite_url(OPTUNA_DB),
                                  "-o", UNWRITABLE], "cannot write"),
    "export unknown column": (["export", "rmsnorm", "--storage", sqlite_url(OPTUNA_DB),
                               "--format", "csv", "--columns", "nosuchcolumn"],
                              "unknown column nosuchcolumn"),
    "export unknown op": (["export", "nosuchop", "--storage", sqlite_url(OPTUNA_DB)],
                          "unknown op 'nosuchop'"),
    # status
    "status --op nosuchop": (["status", "--storage", sqlite_url(OPTUNA_DB), "--op",
                              "nosuchop"], "unknown op 'nosuchop'"),
    "status of a foreign SQLite file": (["status", "--storage", sqlite_url(FOREIGN_DB)],
                                        "not an Optuna storage"),
    "status of a missing file": (["status", "--storage", "sqlite:///nothing-here.db"],
                                 "no results at"),
    # worker
    "worker on a foreign SQLite file": (["worker", "--storage", sqlite_url(FOREIGN_DB)],
                                        "SQLite, which cannot serve parallel workers"),
    "worker on a file that is no journal": (["worker", "--storage",
                                             f"journal:{FOREIGN_JOURNAL}"],
                                            "not an Optuna storage"),
    "worker where no sweep is planned": (["worker", "--storage", sqlite_url(OPTUNA_DB)],
                                         "SQLite, which cannot serve parallel workers"),
    # list
    "list with a missing plugin": (["list", "--plugin", "no-such-plugin.py"], "no-such-plugin"),
}


@pytest.mark.parametrize("argv, fix", list(CASES.values()), ids=list(CASES))
def test_every_command_refuses_bad_input_in_one_line(
    place: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fix: str
) -> None:
    before = _snapshot(place)
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("fusionlab: "), captured.err
    assert fix in lines[0], lines[0]
    assert captured.out == ""
    assert _snapshot(place) == before  # nothing written, no tables created


def _no_winners(folder: Path) -> str:
    path = folder / "winners.json"
    path.write_text('{"meta": {"op": "rmsnorm", "version": 1}, "rows": []}')
    return str(path)


def test_the_dispatcher_refuses_what_it_cannot_dispatch(tmp_path: Path) -> None:
    dispatch = Dispatcher("rmsnorm", winners=_no_winners(tmp_path))
    weight = torch.rand(8) + 0.5
    for dtype in (torch.int32, torch.float64):
        x = torch.ones(2, 8, dtype=dtype)
        with pytest.raises(TypeError, match="fusionlab measures and dispatches float32"):
            dispatch(x, weight, 1e-6)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        dispatch([[1.0] * 8] * 2, weight, 1e-6)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        dispatch()
    with pytest.raises(ValueError, match="rank_by must be one of cold, warm"):
        Dispatcher("rmsnorm", winners=_no_winners(tmp_path), rank_by="fastest")


def test_the_python_api_refuses_bad_input_and_writes_nothing(place: Path) -> None:
    before = _snapshot(place)
    with pytest.raises(UserError, match="does not parse"):
        api.sweep("rmsnorm", "\u00b2x4096", storage=sqlite_url(place / "api.db"))
    with pytest.raises(UserError, match="--timeout must be at most"):
        api.sweep("rmsnorm", "4x256", timeout_s=float("inf"),
                  storage=sqlite_url(place / "api.db"))
    with pytest.raises(UserError, match="not an Optuna storage"):
        api.stored_cells("rmsnorm", storage=sqlite_url(FOREIGN_DB))
    with pytest.raises(UserError, match="not an Optuna storage"):
        Dispatcher("rmsnorm", storage=sqlite_url(FOREIGN_DB))
    assert _snapshot(place) == before

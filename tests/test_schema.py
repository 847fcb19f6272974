"""The result schema (fusionlab/schema.py, records.py, results.py): typed data round-trips through
JSON, data that does not fit is refused naming the field, version 1 data is migrated, newer data
refused in one line, and the reports sit below the search."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import optuna
import pytest
import torch
from conftest import cpu_cell, run_cli
from helpers import TRIAL_TIMING as FAST
from helpers import sqlite_url

from fusionlab import Dispatcher
from fusionlab.devices import get_device
from fusionlab.errors import UserError
from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.records import Status, TrialRecord
from fusionlab.results import Decision, OutOfPlace, Verdict, WinnersFile
from fusionlab.schema import SCHEMA_VERSION, SchemaError
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage
from fusionlab.verdict import Contender, decide

NEWER = SCHEMA_VERSION + 1
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def record() -> TrialRecord:
    """A real trial, measured in this process."""
    measured = run_trial(TrialTask(cpu_cell("rmsnorm", (4, 96)), "naive", {}, seed=3,
                                   timing=FAST))
    assert measured.status is Status.PASSED and measured.accuracy is not None
    return measured


def _verdict() -> Verdict:
    rounds = [[1.0, 1.02, 0.98, 1.01]] * 5
    return decide([Contender("naive", "baseline", 0.1, rounds),
                   Contender("builtin", "builtin", 0.1, [[v / 2 for v in r] for r in rounds])])


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny real sweep and its winners file."""
    folder = tmp_path_factory.mktemp("schema")
    result = run_cli("sweep", "rmsnorm", "--quick", "--shapes", "4x64", "--dtypes", "float32",
                     "--variants", "naive,builtin", "--threads", "1", "--storage",
                     sqlite_url(folder / "r.db"), "--export", "winners.json", cwd=folder)
    assert result.returncode == 0, result.stderr[-2000:]
    return folder, sqlite_url(folder / "r.db")


def test_a_trial_record_round_trips_through_json(record: TrialRecord) -> None:
    data = json.loads(json.dumps(record.to_dict()))
    assert data["schema"] == SCHEMA_VERSION and data["status"] == "passed"
    assert TrialRecord.from_dict(data) == record


def test_a_verdict_round_trips_through_json() -> None:
    verdict = _verdict()
    data = json.loads(json.dumps(verdict.to_dict()))
    assert data["schema"] == SCHEMA_VERSION and data["decision"] == "faster"
    again = Verdict.from_dict(data)
    assert again == verdict and again.decision is Decision.FASTER


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timing": {"median_ms": "0.01"}},
         "field 'timing.median_ms' should be a number, found a string '0.01'"),
        ({"bytes_moved": 1.5}, "field 'bytes_moved' should be an integer, found a number 1.5"),
        ({"cell": {"shape": [4, "96"]}}, "field 'cell.shape[1]' should be an integer"),
        ({"status": "fast"}, "field 'status' should be one of 'passed', 'incorrect'"),
        ({"variant": None}, "field 'variant' should be a string, found null"),
        ({"spare": 1}, "field 'spare' is not part of schema"),
    ],
)
def test_a_record_that_does_not_fit_is_refused_naming_the_field(
    record: TrialRecord, change: dict, message: str
) -> None:
    data = record.to_dict()
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    with pytest.raises(SchemaError) as caught:
        TrialRecord.from_dict(json.loads(json.dumps(data)))
    assert str(caught.value).startswith(f"trial record: {message}"), caught.value
    missing = record.to_dict()
    del missing["variant"]
    with pytest.raises(SchemaError, match=r"^trial record: field 'variant' is missing$"):
        TrialRecord.from_dict(missing)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ci_low", "0.99", "field 'ci_low' should be a number, found a string '0.99'"),
        ("decision", "tie", "field 'decision' should be one of 'faster', 'equivalent'"),
        ("decision", "by cost", "field 'decision' should be one of 'faster', 'equivalent'"),
    ],
)
def test_a_verdict_that_does_not_fit_is_refused(key: str, value: str, message: str) -> None:
    data = {**_verdict().to_dict(), key: value}
    with pytest.raises(SchemaError) as caught:
        Verdict.from_dict(data)
    assert str(caught.value).startswith(f"verdict: {message}"), caught.value
    assert isinstance(caught.value, ValueError)


def test_data_from_a_newer_fusionlab_is_refused_in_one_line(record: TrialRecord) -> None:
    for kind, data in ((TrialRecord, record.to_dict()), (Verdict, _verdict().to_dict())):
        with pytest.raises(SchemaError) as caught:
            kind.from_dict({**data, "schema": NEWER})
        assert str(caught.value) == (
            f"{kind.noun} written by a newer fusionlab (schema {NEWER}); upgrade fusionlab"
        )
    with pytest.raises(SchemaError, match=rf"^winners file written by a newer fusionlab "
                                          rf"\(schema {NEWER}\); upgrade fusionlab$"):
        WinnersFile.from_dict({"meta": {"op": "rmsnorm", "version": NEWER}, "rows": []})


def test_a_version_1_record_is_migrated(record: TrialRecord) -> None:
    old = record.to_dict()
    del old["schema"]
    old["retired"] = "a field this version no longer reads"
    assert TrialRecord.from_dict(old) == record


@pytest.mark.parametrize(
    ("low", "high", "decision"),
    [(0.99, 1.02, "equivalent"), (1.5, 2.0, "faster"), (0.37, 3.85, "inconclusive"),
     (None, None, "only contender")],
)
def test_a_version_1_verdict_without_a_decision_is_classified_from_its_interval(
    low: float | None, high: float | None, decision: str
) -> None:
    old = {  # as fusionlab stored it before outcomes had names: no schema, `tie`, `tie_group`
        "ranking": ["builtin", "naive"], "latency_ms": {"builtin": 0.01, "naive": 0.012},
        "winner": "builtin", "runner_up": None if low is None else "naive",
        "ratio": None if low is None else 1.2, "ci_low": low, "ci_high": high,
        "tie": low is not None and low < 1.03, "tie_group": ["builtin"], "reason": "old",
        "versus_fastest": {}, "confidence": 0.95, "threshold": 0.03, "resamples": 2000,
        "seed": 0, "contenders": ["builtin", "naive"],
    }
    verdict = Verdict.from_dict(old)
    assert verdict.decision == decision and verdict.equivalent_group == ["builtin"]
    assert Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))) == verdict


def test_the_winners_file_holds_typed_numbers(swept: tuple[Path, str]) -> None:
    folder, _ = swept
    data = json.loads((folder / "winners.json").read_text())
    assert data["meta"]["version"] == SCHEMA_VERSION and data["meta"]["op"] == "rmsnorm"
    (row,) = data["rows"]
    assert row["variant"] in {"naive", "builtin"} and row["label"] == row["variant"]
    assert row["runner_up"] in {"naive", "builtin"} - {row["variant"]}
    assert row["runner_up_label"] == row["runner_up"]
    assert all(isinstance(row[key], float) for key in ("ratio", "ci_low", "ci_high",
                                                       "median_ms", "speedup_vs_baseline"))
    assert row["decision"] in {d.value for d in Decision}
    assert isinstance(row["params"], dict) and (row["failed"], row["measured"]) == (0, 2)
    assert WinnersFile.from_dict(data).rows[0].decision is Decision(row["decision"])
    shown = run_cli("export", "rmsnorm", "--storage", swept[1], "--format", "md", cwd=folder)
    assert f"{row['ratio']:.2f}x [{row['ci_low']:.2f}, {row['ci_high']:.2f}]" in shown.stdout


def test_a_winners_row_with_text_for_a_number_is_refused_in_one_line(
    swept: tuple[Path, str], tmp_path: Path
) -> None:
    folder, _ = swept
    data = json.loads((folder / "winners.json").read_text())
    data["rows"][0]["ratio"] = "2.40x [2.30, 2.68]"
    path = tmp_path / "text.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as caught:
        Dispatcher("rmsnorm", winners=str(path))
    assert str(caught.value) == (
        f"{str(path)!r}: winners file: field 'rows[0].ratio' should be a number, found a "
        "string '2.40x [2.30, 2.68]'"
    )


def test_a_version_1_winners_file_is_migrated_and_dispatched(tmp_path: Path) -> None:
    device = get_device("cpu").hardware_name()
    row = {  # a row as fusionlab wrote it before version 2: display text for numbers
        "device": device, "threads": torch.get_num_threads(), "shape": "4x256",
        "dtype": "float32", "fastest": "builtin-inplace (in place)", "params": "-",
        "params_values": {}, "variant": "builtin-inplace", "median_ms": 0.01,
        "runner_up": "builtin", "ratio": "2.40x [2.30, 2.68]", "decision": "faster",
        "failed": "1/3 (1 crashed)", "ranked_by": "cold", "toolchain": {}, "inplace": True,
        "out_of_place": {"variant": "builtin", "params": {}}, "reason": "why",
    }
    nothing = {"device": device, "threads": 1, "shape": "8x256", "dtype": "float32",
               "fastest": "none passed", "params": None, "failed": "2/2 (1 crashed, 1 timeout)"}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"meta": {"op": "add_rmsnorm", "version": 1},
                                "rows": [row, nothing]}))
    winners = WinnersFile.from_dict(json.loads(path.read_text()))
    first, second = winners.rows
    assert (first.variant, first.label, first.params) == ("builtin-inplace", row["fastest"], {})
    assert (first.ratio, first.ci_low, first.ci_high) == (2.40, 2.30, 2.68)
    assert (first.failed, first.measured, first.failures) == (1, 3, {"crashed": 1})
    assert first.decision is Decision.FASTER and first.out_of_place == OutOfPlace("builtin", {})
    assert (second.variant, second.label, second.params) == (None, None, None)
    assert second.failures == {"crashed": 1, "timeout": 1}
    for allow_inplace, expected in ((True, "builtin-inplace"), (False, "builtin")):
        dispatch = Dispatcher("add_rmsnorm", winners=str(path), allow_inplace=allow_inplace)
        choice = dispatch.choose((4, 256), torch.float32, "cpu")
        assert (choice.variant, choice.match, choice.decision) == (expected, "exact", "faster")


def test_commands_refuse_stored_data_from_a_newer_fusionlab_in_one_line(
    swept: tuple[Path, str], tmp_path: Path
) -> None:
    folder, _ = swept
    shutil.copy(folder / "r.db", tmp_path / "r.db")
    url = sqlite_url(tmp_path / "r.db")
    storage = open_storage(url, must_exist=True)
    (summary,) = storage.get_all_studies()
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    verdicts = study.user_attrs[store.VERDICT_ATTR]
    newer = {mode: {**verdict, "schema": NEWER} for mode, verdict in verdicts.items()}
    study.set_user_attr(store.VERDICT_ATTR, newer)
    expected = f"written by a newer fusionlab (schema {NEWER}); upgrade fusionlab"
    for command in (["export", "rmsnorm", "--format", "json"], ["status"]):
        result = run_cli(*command, "--storage", url, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"fusionlab: results in {url}: ")
        assert result.stderr.endswith(f"verdict {expected}\n") and result.stderr.count("\n") == 1
    with pytest.raises(UserError, match=re.escape(f"verdict {expected}")):
        Dispatcher("rmsnorm", storage=url)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_reports_and_the_schema_do_not_import_the_search() -> None:
    below = [*sorted((ROOT / "fusionlab" / "report").glob("*.py"))]
    below += [ROOT / "fusionlab" / f"{name}.py" for name in ("schema", "records", "results")]
    for path in below:
        wrong = {m for m in _imports(path) if m.split(".")[:2] == ["fusionlab", "search"]}
        assert not wrong, f"{path.name} imports {wrong}"
    for name in ("schema", "records", "results"):
        upward = {m for m in _imports(ROOT / "fusionlab" / f"{name}.py")
                  if m.startswith(("fusionlab.report", "fusionlab.measure"))}
        assert not upward, f"{name}.py imports {upward}"

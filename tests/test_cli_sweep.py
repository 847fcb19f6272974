"""The sweep end to end through the real command: statuses, resume, --fresh and exports."""

import csv
import io
import json
import re
import sqlite3
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import PLUGINS, run_cli
from helpers import sqlite_url

from fusionlab.api import stored_cells
from fusionlab.records import Status
from fusionlab.report.tables import best_rows, display_rows
from fusionlab.winners import cell_winner

PLUGIN = str(PLUGINS / "misbehaving.py")
# The timeout ends the hanging variant; honest trials must fit in it with room to spare: on this
# 2-core machine under a load of 15, an honest trial of these shapes took about 10 s.
SWEEP = ["sweep", "rmsnorm", "--quick", "--shapes", "2x64,3x100", "--dtypes", "float32",
         "--variants", "naive,builtin,wrong,aborts,hangs", "--plugin", PLUGIN, "--timeout", "45"]


def _trial_count(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        return connection.execute("select count(*) from trials").fetchone()[0]


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One real sweep with misbehaving variants, shared by the tests below."""
    folder = tmp_path_factory.mktemp("sweep")
    url = sqlite_url(folder / "results.db")
    result = run_cli(*SWEEP, "--storage", url, "--export", "best.csv", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder, url, result.stdout + result.stderr


@pytest.fixture(scope="module")
def exported(swept, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The shared sweep's table exported in a format by the real command, once per format."""
    _, url, _ = swept
    folder = tmp_path_factory.mktemp("exports")
    written: dict[str, Path] = {}

    def export(fmt: str) -> Path:
        if fmt not in written:
            out = folder / f"best.{'tex' if fmt == 'latex' else fmt}"
            result = run_cli("export", "rmsnorm", "--storage", url, "-o", str(out), cwd=folder)
            assert result.returncode == 0, result.stderr
            written[fmt] = out
        return written[fmt]
    return export


def test_misbehaving_variants_are_recorded_and_never_win(swept) -> None:
    folder, url, output = swept
    cells = stored_cells("rmsnorm", url)
    assert len(cells) == 2
    for cell in cells:
        statuses = {r.variant: r.status for r in cell.records}
        assert statuses == {"naive": Status.PASSED, "builtin": Status.PASSED,
                            "wrong": Status.INCORRECT, "aborts": Status.CRASHED,
                            "hangs": Status.TIMEOUT}
        assert cell.ranked()[0].variant in {"naive", "builtin"}
    rows = list(csv.DictReader((folder / "best.csv").open()))
    assert [row["fastest"] for row in rows] == [cell_winner(c).record.variant for c in cells]
    assert all(row["failed"] == "3/5 (1 crashed, 1 incorrect, 1 timeout)" for row in rows)
    for row in rows:  # every row shows its share of the device's own copy limit
        assert _number(row["% fresh copy"]) > 0 and _number(row["% in-place copy"]) > 0
        assert row["decision"].rstrip("!") in {"faster", "equivalent", "inconclusive"}
        assert "[" in row["runner-up/winner [95% CI]"]
    assert "SIGABRT" in output and "TIMEOUT" in output and "INCORRECT" in output
    # What the re-measurement added to the search, for both cells, in wall time.
    assert re.search(r"measured 10 configurations in [\d.]+ s; re-measuring 2 cells took "
                     r"[\d.]+ s more \(\+\d+%\)", output), output
    # How the cells ended, and what rounds beyond the minimum cost.
    assert re.search(r"[\d.]+ s of it in \d+ rounds beyond the first 5 of a cell \(budget 3 s "
                     r"a cell\), [\d.]+ s in the audit of every contender \(\+\d+% of the "
                     r"search\); cells: \d+ (faster|equivalent|inconclusive)", output), output


def test_rerun_resumes_without_measuring(swept) -> None:
    folder, url, _ = swept
    before = _trial_count(folder / "results.db")
    again = run_cli(*SWEEP, "--storage", url, cwd=folder)
    assert again.returncode == 0, again.stderr
    assert _trial_count(folder / "results.db") == before
    assert "] 2x64" not in again.stderr  # no progress line: nothing was measured
    assert "re-measuring" not in again.stderr
    assert "winner" in again.stdout


def test_fresh_measures_again(tmp_path: Path, storage_url: str) -> None:
    args = ["sweep", "rmsnorm", "--quick", "--shapes", "2x32", "--variants", "builtin",
            "--storage", storage_url]
    assert run_cli(*args, cwd=tmp_path).returncode == 0
    fresh = run_cli(*args, "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0 and "[1/1] 2x32" in fresh.stderr
    assert len(stored_cells("rmsnorm", storage_url)[0].records) == 1


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")

    def handle_data(self, data: str) -> None:
        if self.rows and self.rows[-1]:
            self.rows[-1][-1] += data.strip()


def _parse(fmt: str, text: str) -> list[list[str]]:
    if fmt == "csv":
        return list(csv.reader(io.StringIO(text)))
    if fmt == "md":
        lines = [line for line in text.splitlines() if line.startswith("|")]
        del lines[1]  # the |---| rule
        return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    if fmt == "latex":
        lines = [line for line in text.splitlines() if line.endswith("\\\\")]
        unescaped = {"\\_": "_", "\\%": "%", "\\textasciitilde{}": "~"}
        rows = [[c.strip() for c in line[:-2].split("&")] for line in lines]
        for escaped, plain in unescaped.items():
            rows = [[c.replace(escaped, plain) for c in row] for row in rows]
        return rows
    parser = _Cells()
    parser.feed(text)
    return parser.rows


@pytest.mark.parametrize("fmt", ["md", "csv", "latex", "html", "json"])
def test_exports_parse_back_to_the_same_rows(swept, exported, fmt: str) -> None:
    _, url, _ = swept
    out = exported(fmt)
    rows = best_rows(stored_cells("rmsnorm", url))
    if fmt == "json":
        written = json.loads(out.read_text())["rows"]
        expected_rows = json.loads(json.dumps([row.to_dict() for row in rows]))
        differences = [(i, key, row.get(key), expected_rows[i].get(key))
                       for i, row in enumerate(written) for key in row | expected_rows[i]
                       if row.get(key) != expected_rows[i].get(key)]
        assert len(written) == len(expected_rows) and not differences, differences
        return
    shown = display_rows(rows, "rmsnorm")
    expected = [list(shown[0])] + [list(row.values()) for row in shown]
    assert _parse(fmt, out.read_text()) == expected


def _number(text: str) -> float:
    """The figure of a table cell: `~` (noisy: fewer digits) and `!` (measured while busy)
    around it, an interval after it."""
    return float(text.split()[0].strip("~!").rstrip("x"))


def _exported_rows(fmt: str, out: Path) -> list[dict]:
    """An export's rows by column header; JSON's typed numbers checked, then keyed and shown as
    the text tables' headers and strings are."""
    if fmt != "json":
        header, *body = _parse(fmt, out.read_text())
        return [dict(zip(header, row, strict=True)) for row in body]
    rows = json.loads(out.read_text())["rows"]
    for row in rows:  # typed numbers, the winner's name apart from its label
        assert (row["failed"], row["measured"]) == (3, 5)
        assert row["failures"] == {"crashed": 1, "incorrect": 1, "timeout": 1}
        assert all(isinstance(row[key], float) for key in ("ratio", "ci_low", "ci_high"))
    keys = {"median ms": "median_ms", "warm ms": "warm_ms", "cold ms": "cold_ms",
            "vs naive": "speedup_vs_baseline", "vs builtin": "speedup_vs_builtin",
            "GB/s": "gbps", "fastest": "variant"}
    return [{**row, **{header: str(row[key]) for header, key in keys.items()}} for row in rows]


@pytest.mark.parametrize("fmt", ["md", "csv", "latex", "html", "json"])
def test_exports_carry_the_values_of_the_stored_records(swept, exported, fmt: str) -> None:
    """Each exported row against values computed here from the stored records themselves (the
    stored verdict's winner, its medians, bytes over time), not from the renderers' functions."""
    _, url, _ = swept
    rows = _exported_rows(fmt, exported(fmt))
    cells = {(f"{c.cell.shape[0]}x{c.cell.shape[1]}", c.cell.dtype): c
             for c in stored_cells("rmsnorm", url)}
    assert sorted((row["shape"], row["dtype"]) for row in rows) == sorted(cells)
    exact = fmt == "json"
    for row in rows:
        cell = cells[(row["shape"], row["dtype"])]
        records = {r.variant: r for r in cell.records}
        verdict = cell.verdicts["cold"]
        winner = records[verdict.winner]
        cold_ms, warm_ms = winner.cold.median_ms, winner.timing.median_ms
        assert row["fastest"] == winner.variant
        # Against the baselines: measured in the same rounds as the winner (paired), never a
        # ratio of the search medians.
        paired = {name: verdict.versus_winner[records[name].config_label()][0]
                  if name != winner.variant else 1.0 for name in ("naive", "builtin")}
        expected = {
            "median ms": cold_ms, "cold ms": cold_ms, "warm ms": warm_ms,
            "vs naive": paired["naive"], "vs builtin": paired["builtin"],
            "GB/s": winner.bytes_moved / (cold_ms * 1e-3) / 1e9,
        }
        for column, value in expected.items():
            # Text shows 3 significant digits, speedups 2 decimals; JSON keeps the numbers.
            tolerance = {"rel": 1e-12} if exact else (
                {"abs": 0.006} if column.startswith("vs ") else
                {"rel": 0.05 if row[column].startswith("~") else 0.006})
            assert _number(row[column]) == pytest.approx(value, **tolerance), (column, row)
        if not exact:
            assert row["failed"] == "3/5 (1 crashed, 1 incorrect, 1 timeout)"

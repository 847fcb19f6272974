"""`fusionlab report`: a real quick sweep's page, opened in headless Chromium with the network
off: no console errors, nothing fetched, the plots drawn."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import optuna
import pytest
from browser import chromium, visit
from conftest import PLUGINS, run_cli
from helpers import sqlite_url
from PIL import Image

needs_browser = pytest.mark.skipif(
    chromium() is None and not os.environ.get("FUSIONLAB_REQUIRE_BROWSER"),
    reason="Chromium is not installed (.ci/run installs it: apt-get install chromium)",
)
TAB10_BLUE = (31, 119, 180)  # matplotlib's first line colour


def _near(rgb: tuple[int, int, int], target: tuple[int, int, int]) -> bool:
    return max(abs(a - b) for a, b in zip(rgb, target, strict=True)) < 12


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("report")
    url = sqlite_url(folder / "results.db")
    sweep = run_cli(
        "sweep", "rmsnorm", "--quick", "--device", "cpu", "--storage", url,
        "--plugin", str(PLUGINS / "gaming.py"),
        "--variants", "naive,builtin,game-skip-after-first", cwd=folder,
    )
    assert sweep.returncode == 0, sweep.stderr
    made = run_cli(
        "report", "rmsnorm", "--storage", url, "-o", "page.html", "--plots", "plots", cwd=folder
    )
    assert made.returncode == 0, made.stderr
    return folder, (folder / "page.html").read_text()


def test_the_page_is_self_contained(report) -> None:
    _, page = report
    assert "<script" not in page and "<link" not in page
    assert not re.findall(r'(?:src|href)="(?!data:|#)', page)  # nothing to fetch
    assert "@import" not in page and "url(http" not in page


def test_the_page_holds_every_variant_decisions_failures_and_toolchain(report) -> None:
    _, page = report
    for cell in ("1x4096 float32", "256x4096 float32"):
        assert f"<h3>{cell}" in page
    assert page.count("decision: ") == 2
    assert page.count("<td>naive</td>") >= 2 and page.count("<td>builtin</td>") >= 2
    failures = page[page.index("<h2>Failures</h2>") : page.index("<h2>Environment")]
    assert "game-skip-after-first" in failures
    assert re.search(r"<td>(stale_result|incorrect|suspicious)</td>", failures)
    environment = page[page.index("<h2>Environment") :]
    assert "fusionlab" in environment and "kernels" in environment


def test_plots_are_written_as_files(report) -> None:
    folder, _ = report
    names = sorted(path.name for path in (folder / "plots").iterdir())
    assert names == [
        "scaling-h4096-float32.png", "scaling-h4096-float32.svg", "winners.png", "winners.svg"
    ]
    assert Image.open(folder / "plots" / "winners.png").size[0] > 200


def test_a_page_that_needs_the_network_or_throws_is_caught(tmp_path: Path) -> None:
    """The check below can fail: a console error, an exception and a fetch are all seen."""
    if chromium() is None and not os.environ.get("FUSIONLAB_REQUIRE_BROWSER"):
        pytest.skip("Chromium is not installed")
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><body><p>x</p><img src='https://example.com/a.png'>"
        "<script>console.error('boom'); missing();</script></body></html>"
    )
    seen = visit(bad.as_uri(), {})
    assert "boom" in seen.errors
    assert any("ERR_" in error for error in seen.errors)  # the fetch failed: no network
    assert "https://example.com/a.png" in seen.requests


@needs_browser
def test_the_report_renders_in_chromium_offline(report) -> None:
    folder, _ = report
    seen = visit(
        (folder / "page.html").as_uri(),
        {
            "figures": "document.querySelectorAll('figure > svg').length",
            "drawn": "[...document.querySelectorAll('figure > svg')].map("
            "s => s.getBoundingClientRect().width * s.getBoundingClientRect().height)",
            "lines": "document.querySelectorAll('#scaling-h4096-float32 svg path').length",
            "legend": "document.querySelector('#scaling-h4096-float32').textContent",
            "heatmap": "document.querySelector('#winners').textContent",
        },
    )
    assert seen.errors == []
    assert all(url.startswith(("file:", "data:")) for url in seen.requests), seen.requests
    assert seen.values["figures"] == 2
    assert all(area > 40_000 for area in seen.values["drawn"])
    assert seen.values["lines"] > 20  # axes, ticks, one line and error bars per variant
    assert "naive" in seen.values["legend"] and "builtin" in seen.values["legend"]
    assert "vs naive" in seen.values["heatmap"]
    shot = Image.open(io.BytesIO(seen.screenshot)).convert("RGB")
    colours = shot.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50  # text, tables and plots, not a blank page
    blue = sum(n for n, rgb in colours if _near(rgb, TAB10_BLUE))
    assert blue > 100  # the first variant's line is on screen


def test_studies_name_their_objective_and_summarise_each_trial(report) -> None:
    """What optuna-dashboard shows: the objective with its unit, a readable line per trial."""
    folder, _ = report
    storage = optuna.storages.RDBStorage(sqlite_url(folder / "results.db"))
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        assert study.metric_names == ["cold median latency (ms)"]
        measured = [t.user_attrs["measured"] for t in study.trials if "measured" in t.user_attrs]
        assert any(line.startswith("naive: cold ") and " ms" in line for line in measured)
        assert any(line.startswith("game-skip-after-first: ") for line in measured)


def test_bad_input_gets_one_line_and_writes_nothing(tmp_path: Path, storage_url: str) -> None:
    empty = run_cli("sweep", "rmsnorm", "--quick", "--variants", "naive", "--shapes", "2x64",
                    "--storage", storage_url, cwd=tmp_path)
    assert empty.returncode == 0, empty.stderr
    for args, says in (
        (("report", "nosuchop", "--storage", storage_url), "unknown op 'nosuchop'"),
        (("report", "layernorm", "--storage", storage_url), "no results of layernorm"),
        (("report", "rmsnorm", "--storage", storage_url, "-o", "missing/dir/r.html"),
         "does not exist"),
    ):
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "report.html").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get_json(url: str, deadline: float) -> dict:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_optuna_dashboard_lists_named_objectives_and_no_failed_remeasurement(report) -> None:
    """optuna-dashboard itself, on loopback, over the quick sweep's storage: every study names
    its objective; its re-measurement is a PRUNED trial saying what it decided, and the only
    FAIL trials are measurements that failed (the cheating variant's)."""
    folder, _ = report
    dashboard = Path(sys.executable).with_name("optuna-dashboard")
    port = _free_port()
    server = subprocess.Popen(
        [str(dashboard), sqlite_url(folder / "results.db"), "--host", "127.0.0.1",
         "--port", str(port), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}/api/studies"
        studies = _get_json(base, time.monotonic() + 60)["study_summaries"]
        assert len(studies) == 2  # the two quick shapes
        for summary in studies:
            detail = _get_json(f"{base}/{summary['study_id']}", time.monotonic() + 30)
            assert detail["objective_names"] == ["cold median latency (ms)"]
            trials = [(t["state"], {a["key"]: a["value"] for a in t["user_attrs"]})
                      for t in detail["trials"]]
            remeasured = [(state, attrs) for state, attrs in trials
                          if attrs.get("config", "").startswith("verdict:")]
            assert remeasured and all(state == "Pruned" for state, _ in remeasured)
            assert all(attrs["closed"].startswith("re-measured: ") for _, attrs in remeasured)
            failed = [attrs for state, attrs in trials if state == "Fail"]
            assert failed, "the cheating variant's measurement fails in every cell"
            assert all(attrs["measured"].startswith("game-skip-after-first: ") for attrs in failed)
    finally:
        server.terminate()
        server.wait(timeout=30)

"""The three commands a newcomer runs on a model, as real subprocesses: capture, sweep
--from-capture, bench-model; and their bad inputs, one line and exit code 2 each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import run_cli
from helpers import sqlite_url

from fusionlab.model.capture import Capture
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage

CONFIG = "hidden_size=64,intermediate_size=128,num_hidden_layers=1"


def _one_line_exit_2(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def test_capture_sweep_and_bench_model(tmp_path: Path) -> None:
    captured = run_cli("capture", "--model", "llama-tiny", "--config", CONFIG, "--tokens", "8",
                       "-o", "cap.json", cwd=tmp_path)
    assert captured.returncode == 0, captured.stderr[-2000:]
    assert captured.stdout.count("LlamaRMSNorm") == 6
    found = Capture.load(tmp_path / "cap.json")
    url = sqlite_url(tmp_path / "r.db")
    swept = run_cli("sweep", "rmsnorm", "--from-capture", "cap.json", "--quick", "--variants",
                    "builtin,naive", "--storage", url, cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr[-2000:]
    cells = load_cells(open_storage(url, must_exist=True), "rmsnorm")
    assert sorted(c.cell.shape for c in cells) == [(1, 1, 64), (1, 8, 64)]
    assert {c.cell.threads for c in cells} == {found.threads}

    bench = run_cli("bench-model", "--capture", "cap.json", "--storage", url, "--runs", "3",
                    cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert "measured gain [95% CI]" in bench.stdout and "not fused" in bench.stdout
    rows = [line.split() for line in bench.stdout.splitlines() if line.startswith(("prefill",
                                                                                  "decode"))]
    assert [row[0] for row in rows] == ["prefill", "decode"]
    assert all(row[-1] == "100.0%" for row in rows)  # argmax agreement with the unpatched model

    winners = tmp_path / "elsewhere.json"
    exported = run_cli("export", "rmsnorm", "--format", "json", "-o", str(winners),
                       "--storage", url, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    data = json.loads(winners.read_text())
    for row in data["rows"]:
        row["device"] = "another machine"
    winners.write_text(json.dumps(data))
    refused = run_cli("bench-model", "--capture", "cap.json", "--winners", str(winners),
                      cwd=tmp_path)
    assert "nothing to patch" in _one_line_exit_2(refused)


def test_unknown_model_and_bad_config_are_one_line(tmp_path: Path) -> None:
    assert "unknown model 'nope'" in _one_line_exit_2(
        run_cli("capture", "--model", "nope", cwd=tmp_path)
    )
    assert "write NAME=VALUE" in _one_line_exit_2(
        run_cli("capture", "--model", "llama-tiny", "--config", "hidden_size", cwd=tmp_path)
    )
    assert not (tmp_path / "capture.json").exists()

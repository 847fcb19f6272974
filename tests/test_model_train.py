"""bench-model --train on a tiny random Llama: training steps timed patched against an unpatched
copy, each one's peak memory, every parameter's gradient compared (a planted wrong backward is
caught and marked); the bad inputs one line and exit code 2 each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import PLUGINS, run_cli
from helpers import sqlite_url

from fusionlab import capture, causal_lm_steps, sweep, tiny_model
from fusionlab.cli import main
from fusionlab.measure.peak_memory import memory_use
from fusionlab.report import export
from fusionlab.report.tables import best_rows
from fusionlab.results import WinnersFile
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage
from fusionlab.shapes import format_shape

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
TOKENS = 8
NORM_GROUPS = {"model.layers.*.input_layernorm.weight",
               "model.layers.*.post_attention_layernorm.weight", "model.norm.weight"}


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """A capture that says how to make its model, its norm shapes swept; the model's parameter
    bytes."""
    root = tmp_path_factory.mktemp("train")
    model = tiny_model("llama-tiny", overrides=SMALL)
    found = capture(model, causal_lm_steps(model, TOKENS), repeats=3,
                    recipe={"model": "llama-tiny", "config": SMALL, "tokens": [TOKENS]})
    found.save(root / "cap.json")
    url = sqlite_url(root / "r.db")
    shapes = ",".join(sorted({format_shape(c.shape) for c in found.of_op("rmsnorm")}))
    sweep("rmsnorm", shapes, "float32", storage=url, quick=True, variants="builtin")
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return root, url, parameter_bytes


def _train_row(out: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith("train "))


def _gradient_rows(out: str) -> dict[str, str]:
    """Parameter group -> its printed max relative difference (with the mark, if any)."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) >= 5 and cells[0].endswith(".weight"):
            rows[cells[0]] = " ".join(cells[2:-2])
    return rows


def test_bench_model_train_times_both_and_gradients_match(swept) -> None:
    root, url, parameter_bytes = swept
    result = run_cli("bench-model", "--capture", "cap.json", "--storage", url, "--runs", "3",
                     "--train", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    row = _train_row(result.stdout)
    unpatched_ms, patched_ms = float(row[6]), float(row[7])
    assert unpatched_ms > 0 and patched_ms > 0
    assert row[4] == "->"  # a prediction from the norms' forward+backward calls
    kept = [float(row[-6]) * 2**20, float(row[-4]) * 2**20]  # "a / b" unpatched / patched
    peaks = [float(row[-3]) * 2**20, float(row[-1]) * 2**20]
    # a step's gradients (one per parameter) are live at its end: the peak holds at least them
    assert all(peak >= 0.9 * parameter_bytes for peak in peaks), (peaks, parameter_bytes)
    logits_bytes = TOKENS * 256 * 4  # kept for backward: at least the logits
    assert all(logits_bytes <= k < max(peaks) for k in kept), (kept, peaks)
    gradients = _gradient_rows(result.stdout)
    assert len(gradients) == 12 and NORM_GROUPS.issubset(gradients)
    assert not any("[differs]" in value for value in gradients.values())
    assert "gradients differ" not in result.stderr


def _winners_with(url: str, path: Path, variant: str) -> str:
    """The sweep's real winners file, every row's variant replaced."""
    rows = best_rows(load_cells(open_storage(url, must_exist=True), "rmsnorm"), "cold", None)
    data = json.loads(export.render(WinnersFile("rmsnorm", rows, storage=url), "json"))
    for row in data["rows"]:
        row.update(variant=variant, label=variant)
    path.write_text(json.dumps(data))
    return str(path)


def test_a_planted_wrong_backward_is_caught_and_marked(swept) -> None:
    root, url, _ = swept
    winners = _winners_with(url, root / "wrong.json", "scaled_dweight")
    result = run_cli("bench-model", "--capture", "cap.json", "--winners", winners, "--plugin",
                     str(PLUGINS / "wrong_backward.py"), "--runs", "2", "--train", cwd=root)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "scaled_dweight" in result.stdout  # it was patched in: its forward is right
    marked = {name for name, value in _gradient_rows(result.stdout).items()
              if value.endswith("[differs]")}
    assert marked == NORM_GROUPS  # dweight is wrong; dx, and so every other gradient, is right
    warned = [line for line in result.stderr.splitlines() if "gradients differ" in line]
    assert len(warned) == 3 and all("0.5 >" in line for line in warned), result.stderr


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_train_refuses_what_it_cannot_train(swept, tmp_path: Path, monkeypatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    root, url, _ = swept
    monkeypatch.chdir(tmp_path)
    factories = PLUGINS / "model_factories.py"
    assert main(["capture", "--model", f"{factories}:frozen_llama", "--tokens", "4",
                 "-o", "frozen.json"]) == 0
    assert main(["capture", "--model", f"{factories}:normed_mlp", "--inputs",
                 f"{factories}:mlp_inputs", "-o", "mlp.json"]) == 0
    capsys.readouterr()
    bench = ["bench-model", "--storage", url, "--train"]
    assert "has no trainable parameters" in _one_line_exit_2(
        [*bench, "--capture", "frozen.json"], capsys)
    assert "not on token ids" in _one_line_exit_2([*bench, "--capture", "mlp.json"], capsys)
    assert "at least 2 tokens" in _one_line_exit_2(
        [*bench, "--capture", str(root / "cap.json"), "--tokens", "1"], capsys)
    assert not list(tmp_path.glob("*.db"))


def test_memory_use_sees_what_torch_allocates_inside_the_call() -> None:
    before = torch.randn(256, 1024)  # live before the call: not counted

    def call() -> torch.Tensor:
        first = before * 2  # 1 MiB
        second = first + 1  # 1 MiB, both live
        del first
        return second * 3  # 1 MiB, with `second`: still 2 MiB at most; 1 MiB returned

    use = memory_use(call, torch.device("cpu"))
    assert 2 * 2**20 <= use.peak < 2 * 2**20 + 4096
    assert 2**20 <= use.retained < 2**20 + 4096


"""patch(mode="training") takes a key's `--pass forward+backward` winner where the storage has
one, else the forward's, and its report says which pass chose each module's kernel: a tiny
random Llama, built from its config."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import sqlite_url

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.shapes import format_shape

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
TOKENS = 8


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """The capture; a storage with forward cells only (builtin); a copy with forward+backward
    cells too, where only naive ran, so each pass has its own winner."""
    root = tmp_path_factory.mktemp("training-winners")
    model = tiny_model("llama-tiny", overrides=SMALL)
    found = capture(model, causal_lm_steps(model, TOKENS), repeats=2)
    found.save(root / "cap.json")
    shapes = ",".join(sorted({format_shape(c.shape) for c in found.of_op("rmsnorm")}))
    forward_only = root / "forward.db"
    sweep("rmsnorm", shapes, "float32", storage=sqlite_url(forward_only), quick=True,
          variants="builtin")
    both = root / "both.db"
    shutil.copy(forward_only, both)
    sweep("rmsnorm", shapes, "float32", storage=sqlite_url(both), quick=True,
          variants="naive", pass_name="forward+backward")
    return root / "cap.json", sqlite_url(forward_only), sqlite_url(both)


def _train_step(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), generator=torch.Generator())
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return model.model.norm.weight.grad


def _report_rows(handle) -> list[list[str]]:
    """The report's rows of rmsnorm modules, split into words."""
    return [line.split() for line in handle.report().splitlines()
            if line.split()[1:2] == ["rmsnorm"]]


def test_training_takes_the_forward_backward_winner_and_says_so(swept) -> None:
    cap, _, both = swept
    model = tiny_model("llama-tiny", overrides=SMALL)
    handle = patch(model, str(cap), storage=both, mode="training")
    assert "from pass" in handle.report().splitlines()[0]
    rows = _report_rows(handle)
    assert len(rows) == 6  # 3 norms at the prefill and decode keys
    assert all(row[4:6] == ["naive", "forward+backward"] for row in rows), rows
    grad = _train_step(model)
    assert grad is not None and grad.abs().sum() > 0
    handle.undo()
    inference = patch(model, str(cap), storage=both, mode="inference")
    assert "from pass" not in inference.report()
    assert all(row[4] == "builtin" for row in _report_rows(inference))
    inference.undo()


def test_training_falls_back_to_the_forward_winner(swept) -> None:
    cap, forward_only, _ = swept
    model = tiny_model("llama-tiny", overrides=SMALL)
    handle = patch(model, str(cap), storage=forward_only, mode="training")
    rows = _report_rows(handle)
    assert len(rows) == 6 and all(row[4:6] == ["builtin", "forward"] for row in rows), rows
    assert _train_step(model) is not None
    handle.undo()

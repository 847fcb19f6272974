"""Fusion candidates from the traced graph of a model's step: residual add + norm (with whether
the sum is reused), QK-norms, casts and a scale around a norm; counted exactly for tiny random
Llama, Qwen3 and GPT-2; swept at their keys with `sweep add_rmsnorm --from-capture`; a model dynamo
cannot trace keeps its module capture and says so in one line; version 1 files still load."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import sqlite_url
from torch import nn
from transformers import GPT2Config, LlamaConfig, Qwen3Config

from fusionlab.cli import main
from fusionlab.commands.capture import print_candidates
from fusionlab.model.capture import Capture, capture
from fusionlab.model.models import causal_lm_steps, random_causal_lm
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage

LAYERS, HIDDEN, TOKENS = 2, 64, 8
SIZES = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": LAYERS,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


def _captured(config: object) -> Capture:
    model = random_causal_lm(config)
    return capture(model, causal_lm_steps(model, TOKENS), repeats=2, candidates=True)


def _of(found: Capture, step: str, kind: str) -> dict[str, object]:
    return {c.path: c for c in found.candidates if c.step == step and c.kind == kind}


def test_llama_has_an_add_before_every_norm_but_the_first() -> None:
    found = _captured(LlamaConfig(**SIZES))
    assert (found.trace_problem, found.traced, found.untraced) == ("", "prefill", [])
    for step, tokens in (("prefill", TOKENS), ("decode", 1)):
        adds = _of(found, step, "add+norm")
        # 2L norms in the layers and the final one; only layer 0's input norm reads the
        # embeddings rather than a sum: 2L adds feed a norm
        assert len(adds) == 2 * LAYERS
        assert "model.layers.0.input_layernorm" not in adds and "model.norm" in adds
        assert {c.op for c in adds.values()} == {"add_rmsnorm"}
        assert {c.key for c in adds.values()} == {f"1x{tokens}x{HIDDEN} float32"}
        # the residual stream reuses every sum but the last, which only the final norm reads
        assert [p for p, c in adds.items() if not c.sum_reused] == ["model.norm"]
        assert all(c.calls == 1 and c.call_us > 0 for c in adds.values())
        assert not _of(found, step, "qk-norm")


def test_qwen3_lists_its_qk_norms_as_their_own_keys() -> None:
    found = _captured(Qwen3Config(**SIZES, head_dim=16))
    assert found.trace_problem == ""
    assert len(_of(found, "prefill", "add+norm")) == 2 * LAYERS
    qk = _of(found, "prefill", "qk-norm")
    assert Counter(c.attention for c in qk.values()) == {"query": LAYERS, "key": LAYERS}
    assert {p.rsplit(".", 1)[-1] for p in qk} == {"q_norm", "k_norm"}
    assert {c.key for c in qk.values() if c.attention == "query"} == {f"1x{TOKENS}x4x16 float32"}
    assert {c.key for c in qk.values() if c.attention == "key"} == {f"1x{TOKENS}x2x16 float32"}
    assert {c.op for c in qk.values()} == {"rmsnorm"}


def test_gpt2_adds_feed_every_layernorm() -> None:
    found = _captured(GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, vocab_size=128,
                                 n_positions=64))
    adds = _of(found, "prefill", "add+norm")
    # token + position embeddings feed layer 0's ln_1 (through an eval-mode dropout), each
    # layer's attention sum feeds ln_2, each layer's output feeds the next ln_1 or ln_f
    assert len(adds) == 2 * LAYERS + 1
    assert {c.op for c in adds.values()} == {"add_layernorm"}
    assert [p for p, c in adds.items() if not c.sum_reused] == ["transformer.ln_f"]


class _CastScale(nn.Module):
    """A bfloat16 residual add, the RMSNorm in float32, its output cast back and scaled, and the
    sum added again after it (reused, as a residual stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        total = x + residual
        return self.norm(total.float()).to(torch.bfloat16) * 0.5 + total


class _DataDependent(nn.Module):
    """A branch on a tensor's value: dynamo cannot trace it into one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        total = x + residual
        if total.sum().item() > 1e9:
            total = total * 2
        return self.norm(total)


def test_casts_and_a_scale_around_a_norm_are_part_of_its_chain() -> None:
    inputs = tuple(torch.randn(4, 16, dtype=torch.bfloat16) for _ in range(2))
    (found,) = capture(_CastScale(), inputs, repeats=2, candidates=True).candidates
    assert (found.kind, found.op, found.key) == ("add+norm", "add_rmsnorm", "4x16 float32")
    assert (found.casts_before, found.casts_after) == (("float32",), ("bfloat16",))
    assert found.scale_after and found.sum_reused
    assert found.pattern() == "add (sum reused) > to(float32) > rmsnorm > to(bfloat16) > scale"


def test_a_model_dynamo_cannot_trace_keeps_its_norm_calls_and_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    found = capture(_DataDependent(), (torch.randn(4, 16), torch.randn(4, 16)), repeats=2,
                    candidates=True)
    capsys.readouterr()
    assert [(c.path, c.op) for c in found.calls] == [("norm", "layernorm")]
    assert found.candidates == [] and found.untraced == ["norm"]
    assert found.trace_problem.startswith("dynamo could not trace the forward step whole (")
    assert "\n" not in found.trace_problem
    print_candidates(found)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found for 1 norm(s) (norm)" in err[0]


def test_sweep_add_rmsnorm_from_capture_sweeps_the_candidates_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    config = "hidden_size=32,intermediate_size=64,num_hidden_layers=1"
    assert main(["capture", "--model", "llama-tiny", "--config", config, "--tokens", "4",
                 "-o", "cap.json"]) == 0
    out = capsys.readouterr().out
    assert "prefill  add+norm  add_rmsnorm  1x4x32 float32" in out
    assert "add (sum reused) > rmsnorm" in out and "add > rmsnorm" in out
    url = sqlite_url(tmp_path / "r.db")
    assert main(["sweep", "add_rmsnorm", "--from-capture", "cap.json", "--quick",
                 "--variants", "builtin", "--storage", url]) == 0
    cells = load_cells(open_storage(url, must_exist=True), "add_rmsnorm")
    assert sorted(c.cell.shape for c in cells) == [(1, 1, 32), (1, 4, 32)]

    # a version 1 file (no candidates) still loads; it has no add_rmsnorm keys to sweep
    data = json.loads((tmp_path / "cap.json").read_text())
    for name in ("candidates", "traced", "trace_problem", "untraced"):
        del data[name]
    (tmp_path / "old.json").write_text(json.dumps({**data, "version": 1}))
    old = Capture.load(tmp_path / "old.json")
    assert old.calls == Capture.load(tmp_path / "cap.json").calls and old.candidates == []
    capsys.readouterr()
    assert main(["sweep", "add_rmsnorm", "--from-capture", "old.json", "--quick",
                 "--storage", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "version 1" in err[0] and "capture the model again" in err[0]

"""Residual add + norm fused in a model: eagerly by `patch(..., fuse=True)` (one fused call per
decoder layer) and under torch.compile by `fusionlab.backend` (every add feeding a norm, across
layer boundaries). Tiny random Llama, Qwen3 (QK-norms) and GPT-2, real sweeps, no mocks."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers
from conftest import run_cli
from helpers import sqlite_url
from torch._dynamo.utils import counters

import fusionlab
from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.model.models import random_causal_lm
from fusionlab.search.storage import open_storage

TOKENS = 8
LAYERS = 2
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS}
QWEN3 = transformers.Qwen3Config(
    hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256,
)
GPT2 = {"n_embd": 64, "n_layer": LAYERS}


def _storage(tmp: Path, op: str, dtype: str = "float32") -> str:
    """A quick sweep of the naive chain at the prefill key (decode resolves to it as nearest)."""
    url = sqlite_url(tmp / f"{op}.db")
    sweep(op, f"1x{TOKENS}x64", dtype, storage=url, quick=True, variants="naive")
    return url


@pytest.fixture(scope="module")
def add_rmsnorm_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _storage(tmp_path_factory.mktemp("fusion"), "add_rmsnorm")


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [step.run() for step in causal_lm_steps(model, TOKENS)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, atol=1e-4, rtol=1e-4)
        agree = (have.argmax(-1) == expected.argmax(-1)).float().mean().item()
        assert agree >= 0.99


def _patched_anywhere(model: torch.nn.Module) -> bool:
    return any("forward" in m.__dict__ for m in model.modules())


def _fuse(model: torch.nn.Module, url: str) -> fusionlab.PatchHandle:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # norms without rmsnorm results keep their forward
        return patch(model, storage=url, fuse=True)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_eager_fuse_runs_one_fused_call_per_layer_and_undoes(name, add_rmsnorm_url) -> None:
    model = (tiny_model("llama-tiny", overrides=LLAMA) if name == "llama"
             else random_causal_lm(QWEN3))
    reference = _logits(model)
    handle = _fuse(model, add_rmsnorm_url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = _logits(model)
    _close(fused, reference)
    # causal_lm_steps fills the cache once, then prefill and decode: 3 forwards x 1 per layer
    assert handle.fused_calls() == 3 * LAYERS
    report = handle.report()
    assert f"fused: {LAYERS} layer(s) (model.layers.0, ...)" in report
    assert "post_attention_layernorm as one add_rmsnorm call" in report
    rows = [r for r in handle.all_rows() if r.op == "add_rmsnorm"]
    assert {(r.key, r.match) for r in rows} == {(f"1x{TOKENS}x64 float32", "exact"),
                                                 ("1x1x64 float32", "nearest")}
    assert len(rows) == 2 * LAYERS
    handle.undo()
    assert not _patched_anywhere(model)
    for got, want in zip(_logits(model), reference, strict=True):
        assert torch.equal(got, want)


def test_training_fused_gradients_match_the_unpatched_model(add_rmsnorm_url) -> None:
    model = tiny_model("llama-tiny", overrides=LLAMA)
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(1))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    reference = gradients()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = patch(model, storage=add_rmsnorm_url, fuse=True, mode="training")
        fused = gradients()
    assert handle.fused_calls() == LAYERS
    for name, grad in reference.items():
        torch.testing.assert_close(fused[name], grad, atol=1e-4, rtol=1e-4, msg=name)
    handle.undo()


def test_gpt2_fuses_add_layernorm_and_a_rounding_winner_is_refused(tmp_path: Path) -> None:
    model = tiny_model("gpt2-tiny", overrides=GPT2)
    url = _storage(tmp_path, "add_layernorm")
    reference = _logits(model)
    handle = _fuse(model, url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(_logits(model), reference)
    assert handle.fused_calls() == 3 * LAYERS
    assert "ln_2 as one add_layernorm call" in handle.report()
    handle.undo()
    assert not _patched_anywhere(model)

    # bfloat16: the naive chain normalises the float32 sum, the block its bf16-rounded sum
    model = tiny_model("gpt2-tiny", torch.bfloat16, overrides=GPT2)
    _storage(tmp_path, "add_layernorm", "bfloat16")  # into the same storage
    reference = _logits(model)
    handle = _fuse(model, url)
    with pytest.warns(UserWarning, match="keeps its add and norm apart: numerics differ"):
        got = _logits(model)
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
    assert handle.fused_calls() == 0
    assert "naive disagrees with the add + norm" in handle.report()
    handle.undo()


def test_compile_pass_fuses_every_add_before_a_norm_without_graph_break(add_rmsnorm_url) -> None:
    model = tiny_model("llama-tiny", overrides=LLAMA)
    ids = {n: torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
           for n in (TOKENS, 11)}
    with torch.no_grad():
        reference = {n: model(i, use_cache=False).logits for n, i in ids.items()}
        torch._dynamo.reset()
        counters.clear()
        fusing = fusionlab.backend(storage=add_rmsnorm_url, inductor=False)
        compiled = torch.compile(model, backend=fusing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # length 11 has no exact cell: nearest rule
            got = {n: compiled(i, use_cache=False).logits for n, i in ids.items()}
    assert sum(counters["graph_break"].values()) == 0
    # each layer's two adds feed a norm (the next layer's first, or the final one)
    assert fusing.rewrites and all(count == 2 * LAYERS for count in fusing.rewrites)
    assert fusing.fused_calls() == 2 * LAYERS * len(ids)
    for n in ids:
        _close([got[n]], [reference[n]])
    assert "not fused" not in fusing.report()


@pytest.fixture(scope="module")
def add_layernorm_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _storage(tmp_path_factory.mktemp("fusion"), "add_layernorm")


@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_compile_pass_fuses_qwen3_and_gpt2_layers(name, request) -> None:
    """Qwen3 (QK-norms, which no add feeds) and GPT-2 (add + LayerNorm): two adds per layer
    feed a norm (the post-attention one, and the next layer's first or the final one)."""
    model = (random_causal_lm(QWEN3) if name == "qwen3"
             else tiny_model("gpt2-tiny", overrides=GPT2))
    url = request.getfixturevalue("add_rmsnorm_url" if name == "qwen3" else "add_layernorm_url")
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        counters.clear()
        fusing = fusionlab.backend(storage=url, inductor=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # norms without results of their own op keep theirs
            got = torch.compile(model, backend=fusing)(ids, use_cache=False).logits
    assert sum(counters["graph_break"].values()) == 0
    assert fusing.rewrites == [2 * LAYERS]
    assert fusing.fused_calls() == 2 * LAYERS
    _close([got], [reference])


def test_fusing_without_results_or_known_layers_is_refused_in_one_line(
    add_rmsnorm_url, tmp_path: Path
) -> None:
    gpt2 = tiny_model("gpt2-tiny", overrides=GPT2)
    with pytest.raises(UserError, match=r"fuse=True: no add_layernorm results to fuse with"):
        patch(gpt2, storage=add_rmsnorm_url, fuse=True)
    empty = sqlite_url(tmp_path / "empty.db")
    open_storage(empty)  # a real storage with no results in it
    with pytest.raises(UserError, match=r"fusionlab.backend: no add_layernorm or add_rmsnorm"):
        fusionlab.backend(storage=empty)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(UserError, match="Sequential has no decoder layer of a known shape"):
        patch(plain, storage=add_rmsnorm_url, fuse=True)
    assert not _patched_anywhere(gpt2) and not _patched_anywhere(plain)


def test_bench_model_fuse_without_results_exits_2_in_one_line(tmp_path: Path) -> None:
    small = {**LLAMA, "num_hidden_layers": 1}
    model = tiny_model("llama-tiny", overrides=small)
    capture(model, causal_lm_steps(model, TOKENS)).save(tmp_path / "cap.json")
    empty = sqlite_url(tmp_path / "empty.db")
    open_storage(empty)
    config = ",".join(f"{key}={value}" for key, value in small.items())
    result = run_cli("bench-model", "--capture", "cap.json", "--model", "llama-tiny", "--config",
                     config, "--tokens", str(TOKENS), "--storage", empty, "--fuse", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "fusionlab: fuse=True: no add_rmsnorm results to fuse with; run `fusionlab sweep "
        "add_rmsnorm --shapes ROWSxHIDDEN` at the model's shapes first"
    ]

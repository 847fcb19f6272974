"""A patched model at sequence lengths it was not captured at, and its numerics: each new key
resolved once (the toolchain read once per process), no graph break under torch.compile with
changing lengths, and in bfloat16 the very logits of the unpatched model. Tiny random models,
real sweeps, no mocks."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers
from conftest import PLUGINS
from helpers import sqlite_url
from torch._dynamo.utils import counters

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.report import export
from fusionlab.report.tables import best_rows
from fusionlab.results import WinnersFile
from fusionlab.runtime import _installed_toolchain
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage
from fusionlab.shapes import format_shape

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
CAPTURED = 8
UNSEEN = (5, 11, 19, 27, 40)
ROUNDING = str(PLUGINS / "rounding.py")


def _ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(tokens))


def _prefill(model: torch.nn.Module, tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(tokens), use_cache=False).logits


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object, str]:
    model = tiny_model("llama-tiny", overrides=SMALL)
    found = capture(model, causal_lm_steps(model, CAPTURED), repeats=3)
    url = sqlite_url(tmp_path_factory.mktemp("lengths") / "swept.db")
    shapes = ",".join(sorted({format_shape(c.shape) for c in found.calls}))
    sweep("rmsnorm", shapes, "float32", storage=url, quick=True, variants="builtin,naive")
    return model, found, url


def test_unseen_lengths_are_resolved_once_per_key_and_match(llama) -> None:
    model, found, url = llama
    reference = {n: _prefill(model, n) for n in UNSEEN}
    handle = patch(model, found, storage=url)
    try:
        toolchain_reads = _installed_toolchain.cache_info().misses
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a nearest match is no reason to warn
            for tokens in UNSEEN:
                torch.testing.assert_close(_prefill(model, tokens), reference[tokens],
                                           atol=1e-4, rtol=1e-4)
        late = [row for module in handle.modules for row in module.late_rows]
        assert len(late) == 3 * len(UNSEEN) and {row.match for row in late} == {"nearest"}
        for tokens in UNSEEN:  # a key seen before resolves nothing again
            _prefill(model, tokens)
        assert len([row for module in handle.modules for row in module.late_rows]) == len(late)
        assert _installed_toolchain.cache_info().misses == toolchain_reads
        assert "1x40x64 float32" in handle.report()
    finally:
        handle.undo()


def test_compiled_patched_model_has_no_graph_break_at_unseen_lengths(llama) -> None:
    model, found, url = llama
    reference = {n: _prefill(model, n) for n in UNSEEN}
    handle = patch(model, found, storage=url)
    torch._dynamo.reset()
    counters.clear()
    try:
        # inductor, as a user compiles: the fake kernel traced, the custom op left opaque;
        # benchmarks/patched_lengths.py times the steady state against the compiled unpatched model
        compiled = torch.compile(model, dynamic=None)
        for tokens in UNSEEN:
            torch.testing.assert_close(_prefill(compiled, tokens), reference[tokens],
                                       atol=1e-4, rtol=1e-4)
        assert dict(counters["graph_break"]) == {}
        # one graph at the first length, one with the length symbolic: no retrace after that
        assert counters["stats"]["unique_graphs"] <= 2
        late = [row for module in handle.modules for row in module.late_rows]
        assert {row.key.split()[0] for row in late} == {f"1x{n}x64" for n in UNSEEN}
    finally:
        handle.undo()
        torch._dynamo.reset()


def _qwen2_bf16() -> torch.nn.Module:
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # norm weights far from their all-ones start
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn(parameter.shape).to(parameter.dtype))
    return model


def _gemma_bf16() -> torch.nn.Module:
    return tiny_model("gemma-tiny", torch.bfloat16, overrides={**SMALL, "num_hidden_layers": 2})


@pytest.fixture(scope="module", params=[_gemma_bf16, _qwen2_bf16], ids=["gemma", "qwen2"])
def bf16_swept(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object, str]:
    """A bf16 model whose prefill key was swept with the plugin's two variants (the decode key
    resolves to the nearest)."""
    model = request.param()
    found = capture(model, causal_lm_steps(model, CAPTURED), repeats=3)
    url = sqlite_url(tmp_path_factory.mktemp("bf16") / "swept.db")
    sweep("rmsnorm", f"1x{CAPTURED}x64", "bfloat16", storage=url, quick=True,
          variants="stats-in-float64,module-formula-slow", plugins=[ROUNDING])
    return model, found, url


def test_bf16_patched_logits_equal_the_unpatched_ones(bf16_swept) -> None:
    """The sweep's winner (`stats-in-float64`) is within bf16 tolerance but rounds some elements
    otherwise than the module: the next fastest variant that rounds like it is taken, and the
    logits are the unpatched model's bit for bit, at the captured length and at new ones."""
    model, found, url = bf16_swept
    reference = {n: _prefill(model, n) for n in (CAPTURED, *UNSEEN[:2])}
    handle = patch(model, found, storage=url)
    try:
        rows = handle.rows
        assert {row.variant for row in rows} == {"module-formula-slow"}
        assert all("stats-in-float64 disagrees with the module" in row.why for row in rows)
        assert all("round otherwise" in row.why and row.numerics == "bit-exact" for row in rows)
        for tokens, logits in reference.items():
            assert torch.equal(_prefill(model, tokens), logits)
        late = [row for module in handle.modules for row in module.late_rows]
        assert late and {row.variant for row in late} == {"module-formula-slow"}
    finally:
        handle.undo()


def test_a_winner_that_cannot_round_like_the_module_alone_patches_nothing(
    bf16_swept, tmp_path: Path
) -> None:
    """A winners file names only the inexact winner: nothing can replace the module, said in one
    line, and nothing is patched."""
    model, found, url = bf16_swept
    rows = best_rows(load_cells(open_storage(url, must_exist=True), "rmsnorm"), "cold", None)
    assert {row.variant for row in rows} == {"stats-in-float64"}
    winners = tmp_path / "winners.json"
    winners.write_text(export.render(WinnersFile("rmsnorm", rows, storage=url), "json"))
    with pytest.raises(UserError, match=r"stats-in-float64 disagrees .* round otherwise"):
        patch(model, found, winners=str(winners))
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_patched_op_passes_torch_library_opcheck(llama) -> None:
    """The op compiled graphs call: schema, fake kernel and AOT dispatch agree with the real one."""
    model, found, url = llama
    handle = patch(model, found, storage=url)
    try:
        x = torch.randn(1, 13, 64)
        for module in handle.modules:
            torch.library.opcheck(torch.ops.fusionlab.patched_norm.default, (x, module.slot))
    finally:
        handle.undo()

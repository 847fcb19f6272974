"""A model's norms captured, swept, patched with the winners and unpatched: tiny random
transformers models (Llama, GPT-2's LayerNorm, Gemma's `1 + weight`), real sweeps, no mocks."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import PLUGINS, run_cli
from helpers import sqlite_url

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.registry import load_plugin, variants_of
from fusionlab.report import export
from fusionlab.report.tables import best_rows
from fusionlab.results import WinnersFile
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import open_storage
from fusionlab.shapes import format_shape

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
TOKENS = 8
COUNTING_MODULE = "fusionlab_plugin_counting_rmsnorm_"


def _model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    overrides = SMALL if name != "gpt2-tiny" else {"n_embd": 64, "n_layer": 1}
    return tiny_model(name, dtype, overrides=overrides)


def _swept(tmp: Path, name: str, op: str) -> tuple[torch.nn.Module, object, str]:
    model = _model(name)
    found = capture(model, causal_lm_steps(model, TOKENS), repeats=3)
    url = sqlite_url(tmp / f"{name}.db")
    shapes = ",".join(sorted({format_shape(c.shape) for c in found.of_op(op)}))
    sweep(op, shapes, "float32", storage=url, quick=True, variants="builtin,naive")
    return model, found, url


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object, str]:
    return _swept(tmp_path_factory.mktemp("llama"), "llama-tiny", "rmsnorm")


def _winners(url: str, tmp: Path, op: str = "rmsnorm", **change: object) -> str:
    """A real winners file exported from the sweep, with fields changed (variant, device...)."""
    rows = best_rows(load_cells(open_storage(url, must_exist=True), op), "cold", None)
    data = json.loads(export.render(WinnersFile(op, rows, storage=url), "json"))
    if "variant" in change:  # the Dispatcher reads a row's variant; `label` is how it is shown
        change.setdefault("label", change["variant"])
    for row in data["rows"]:
        row.update(change)
    path = tmp / "winners.json"
    path.write_text(json.dumps(data))
    return str(path)


def _logits(model: torch.nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [step.run() for step in causal_lm_steps(model, TOKENS)]


def _patched_anywhere(model: torch.nn.Module) -> bool:
    return any("forward" in m.__dict__ for m in model.modules())


def test_capture_records_every_norm_call_with_its_numerics(llama) -> None:
    model, found, _ = llama
    norms = [p for p, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 3
    for step, rows in (("prefill", TOKENS), ("decode", 1)):
        calls = [c for c in found.calls if c.step == step]
        assert sorted(c.path for c in calls) == sorted(norms)
        assert {(c.shape, c.dtype, c.casting, c.offset, c.eps) for c in calls} == {
            ((1, rows, 64), "float32", "llama", 0.0, 1e-6)
        }
    assert all(0 < s.norm_ms < s.step_ms for s in found.steps)


def test_llama_patched_matches_reports_and_undoes(llama, tmp_path: Path) -> None:
    model, found, url = llama
    reference = _logits(model)
    handle = patch(model, found, storage=url)
    assert {r.match for r in handle.rows} == {"exact"} and len(handle.rows) == 6
    assert "model.layers.0.input_layernorm" in handle.report()
    assert "not fused" in handle.report()
    for got, want in zip(_logits(model), reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    handle.undo()
    assert not _patched_anywhere(model)

    load_plugin(str(PLUGINS / "counting_rmsnorm.py"))
    (CALLS,) = (m.CALLS for n, m in sys.modules.items() if n.startswith(COUNTING_MODULE))

    forced = patch(model, found, winners=_winners(url, tmp_path, variant="counting"))
    before = CALLS[0]
    patched = _logits(model)
    assert CALLS[0] - before == 3 * 3  # 3 norms x (the cache-filling prefill, prefill, decode)
    for got, want in zip(patched, reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    forced.undo()
    before = CALLS[0]
    _logits(model)
    assert CALLS[0] == before and not _patched_anywhere(model)


def test_a_winner_that_disagrees_with_the_module_is_not_used(llama, tmp_path: Path) -> None:
    model, found, url = llama
    load_plugin(str(PLUGINS / "misbehaving.py"))
    with pytest.raises(UserError, match="wrong disagrees with the module: max difference"):
        patch(model, found, winners=_winners(url, tmp_path, variant="wrong"))
    assert not _patched_anywhere(model)


def test_bad_winners_and_training_are_refused_in_one_line(llama, tmp_path: Path) -> None:
    model, found, url = llama
    with pytest.raises(UserError, match=r"nothing to patch: .*no float32 results on"):
        patch(model, found, winners=_winners(url, tmp_path, device="another machine"))
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    torch.set_num_threads(other)
    try:
        with pytest.raises(UserError, match=f"this process uses {other}"):
            patch(model, found, storage=url)
    finally:
        torch.set_num_threads(before)
    load_plugin(str(PLUGINS / "counting_rmsnorm.py"))
    with pytest.raises(UserError, match="has no backward"):
        patch(model, found, winners=_winners(url, tmp_path, variant="counting"), mode="training")
    assert not _patched_anywhere(model)


def test_training_gradients_through_a_patched_norm_match(llama) -> None:
    model, found, url = llama
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(1))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(ids, use_cache=False).logits.float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n}

    reference = grads()
    handle = patch(model, found, storage=url, mode="training")
    try:
        patched = grads()
    finally:
        handle.undo()
    assert reference.keys() == patched.keys() and len(patched) == 3
    for name, grad in patched.items():
        torch.testing.assert_close(grad, reference[name], atol=1e-5, rtol=1e-4)


def _breaks_from_fusionlab(model: torch.nn.Module) -> list[str]:
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (1, TOKENS), generator=torch.Generator().manual_seed(2))
    explained = torch._dynamo.explain(model)(ids, use_cache=False)
    return [str(r.reason) for r in explained.break_reasons if "fusionlab" in str(r)]


def test_compiled_patched_model_has_no_graph_break_from_fusionlab(llama, tmp_path: Path) -> None:
    model, found, url = llama
    handle = patch(model, found, winners=_winners(url, tmp_path, variant="naive"))
    try:
        assert _breaks_from_fusionlab(model) == []
    finally:
        handle.undo()


def test_compiled_model_patched_with_cpp_has_no_graph_break(llama, tmp_path: Path) -> None:
    model, found, url = llama
    cpp = variants_of("rmsnorm")["cpp"]
    if cpp.unavailable_reason("cpu"):
        pytest.skip(f"cpp: {cpp.unavailable_reason('cpu')}")
    params = {name: next(iter(space)) for name, space in cpp.tunables.items()}
    handle = patch(model, found,
                   winners=_winners(url, tmp_path, variant="cpp", params=params))
    try:
        assert _breaks_from_fusionlab(model) == []
    finally:
        handle.undo()


def test_gpt2_layernorm_is_captured_swept_and_patched(tmp_path: Path) -> None:
    model, found, url = _swept(tmp_path, "gpt2-tiny", "layernorm")
    assert {c.module_class for c in found.calls} == {"LayerNorm"} and len(found.calls) == 6
    reference = _logits(model)
    handle = patch(model, found, storage=url)
    assert {r.match for r in handle.rows} == {"exact"}
    for got, want in zip(_logits(model), reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    handle.undo()
    assert not _patched_anywhere(model)


@pytest.mark.parametrize(("name", "numerics"), [("gemma-tiny", ("gemma", 1.0)),
                                               ("llama-tiny", ("llama", 0.0))])
def test_bf16_norms_are_patched_with_their_own_numerics(
    name: str, numerics: tuple[str, float], tmp_path: Path
) -> None:
    """bf16 Gemma (`1 + weight`, fp32 throughout) and Llama (rounds before the weight multiply):
    the numerics are captured, the C++ and naive kernels are built with them, and the logits
    match the unpatched model's."""
    model = _model(name, torch.bfloat16)
    found = capture(model, causal_lm_steps(model, TOKENS), repeats=3)
    assert {(c.casting, c.offset) for c in found.calls} == {numerics}
    url = sqlite_url(tmp_path / "bf16.db")
    shapes = ",".join(sorted({format_shape(c.shape) for c in found.calls}))
    sweep("rmsnorm", shapes, "bfloat16", storage=url, quick=True, variants="naive,cpp")
    reference = _logits(model)
    handle = patch(model, found, storage=url)
    assert {r.variant.split("(")[0] for r in handle.rows} <= {"naive", "cpp"}
    assert len(handle.rows) == 6
    for got, want in zip(_logits(model), reference, strict=True):
        torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    handle.undo()
    assert not _patched_anywhere(model)
    # A winner that cannot round like Llama (torch.rms_norm rounds once) is not used.
    if numerics[0] == "llama":
        forced = _winners(url, tmp_path, variant="builtin", params={})
        with pytest.raises(UserError, match="builtin does not compute llama casting"):
            patch(model, found, winners=forced)
        assert not _patched_anywhere(model)


class _Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x).view(-1, 3)


def test_a_failing_forward_or_wrong_inputs_is_one_line() -> None:
    with pytest.raises(UserError, match=r"forward step failed .*RuntimeError") as error:
        capture(_Broken(), torch.randn(4, 16))
    assert "\n" not in str(error.value)
    good = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    found = capture(good, torch.randn(4, 8), repeats=3)
    assert [(c.path, c.op, c.shape) for c in found.calls] == [("1", "layernorm", (4, 16))]
    with pytest.raises(UserError, match="forward step failed"):
        capture(good, torch.randn(4, 5))


def test_bad_capture_files_are_one_line_exit_2(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    model = torch.nn.Sequential(torch.nn.LayerNorm(16))
    found = capture(model, torch.randn(2, 16), repeats=3)
    other = tmp_path / "other.json"
    found.save(other)
    data = json.loads(other.read_text())
    data["calls"][0]["op"] = "fancy_norm"
    other.write_text(json.dumps(data))
    good = tmp_path / "good.json"
    found.save(good)
    for path, op, message in (
        (corrupt, "rmsnorm", "is unreadable"),
        (other, "layernorm", "records ops this install does not have (fancy_norm"),
        (good, "rmsnorm", "records no rmsnorm calls (it holds layernorm)"),
    ):
        result = run_cli("sweep", op, "--from-capture", str(path), "--quick",
                         "--storage", sqlite_url(tmp_path / "x.db"), cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.db").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UserError, match="is unreadable"):
            patch(model, str(corrupt))


def test_a_kernels_layer_repository_kernelizes_the_same_model(llama, tmp_path: Path) -> None:
    from fusionlab.model.hub import write_layer_repository
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    model, _, url = llama
    reference = _logits(model)
    load_plugin(str(PLUGINS / "counting_rmsnorm.py"))
    (CALLS,) = (m.CALLS for n, m in sys.modules.items() if n.startswith(COUNTING_MODULE))
    winners = _winners(url, tmp_path, variant="counting")
    repo = write_layer_repository(tmp_path / "repo", winners={"rmsnorm": winners})
    mapping = {"RMSNorm": {"cpu": LocalLayerRepository(repo_path=repo, layer_name="RMSNorm")}}
    with use_kernel_mapping(mapping):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    try:
        assert all("forward" in m.__dict__ for m in norms) and len(norms) == 3
        for got, want in zip(_logits(model), reference, strict=True):  # resolves each key once
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        before = CALLS[0]
        _logits(model)
        assert CALLS[0] - before == 3 * 3
    finally:
        for module in norms:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_fusionlab_entry", None)
            module.__dict__.pop("_kernel_repo", None)


def test_patch_without_a_capture_resolves_each_key_on_first_use(llama, tmp_path: Path) -> None:
    model, _, url = llama
    reference = _logits(model)
    load_plugin(str(PLUGINS / "counting_rmsnorm.py"))
    (CALLS,) = (m.CALLS for n, m in sys.modules.items() if n.startswith(COUNTING_MODULE))
    handle = patch(model, winners=_winners(url, tmp_path, variant="counting"))
    norms = sorted(p for p, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm")
    assert sorted(m.path for m in handle.modules) == norms and handle.rows == []
    before = CALLS[0]
    for got, want in zip(_logits(model), reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert CALLS[0] - before == 3 * 3 + 6  # every norm call, and one check per key at first use
    before = CALLS[0]
    _logits(model)
    assert CALLS[0] - before == 3 * 3  # resolved: every call goes to the winner, nothing else
    assert sorted((r.path, r.key, r.variant) for r in handle.all_rows()) == sorted(
        (path, f"1x{rows}x64 float32", "counting") for path in norms for rows in (TOKENS, 1)
    )
    handle.undo()
    assert not _patched_anywhere(model)

    from_storage = patch(model, storage=url)
    for got, want in zip(_logits(model), reference, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    rows = from_storage.all_rows()
    assert len(rows) == 6 and {r.match for r in rows} == {"exact"}
    from_storage.undo()
    assert not _patched_anywhere(model)
    with pytest.raises(UserError, match="Linear has no norm module fusionlab can replace"):
        patch(torch.nn.Linear(4, 4), storage=url)


def test_bench_model_on_a_python_capture(llama, tmp_path: Path, monkeypatch, capsys) -> None:
    from fusionlab.cli import main

    model, found, url = llama
    monkeypatch.chdir(tmp_path)
    found.save(tmp_path / "python.json")
    assert main(["bench-model", "--capture", "python.json", "--storage", url]) == 2
    assert "captured from Python and does not say how to make the model" in (
        capsys.readouterr().err
    )
    config = ",".join(f"{name}={value}" for name, value in SMALL.items())
    rebuilt = ["--model", "llama-tiny", "--config", config, "--tokens", str(TOKENS)]
    named = capture(model, causal_lm_steps(model, TOKENS), repeats=3,
                    recipe={"model": "llama-tiny", "config": SMALL, "tokens": [TOKENS]})
    named.save(tmp_path / "named.json")
    for argv in (["--capture", "python.json", *rebuilt], ["--capture", "named.json"]):
        assert main(["bench-model", *argv, "--storage", url, "--runs", "2"]) == 0
        out = capsys.readouterr().out
        rows = [line.split() for line in out.splitlines() if line.startswith(("prefill",
                                                                              "decode"))]
        assert [row[0] for row in rows] == ["prefill", "decode"], out
        assert all(row[-1] == "100.0%" for row in rows)  # argmax agreement with unpatched

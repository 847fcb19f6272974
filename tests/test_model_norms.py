"""No silent skip: every module that looks like a norm is replaced or listed with why. Cohere's
LayerNorm without bias, nn.LayerNorm(bias=False), norm-like modules fusionlab cannot replace, and
the `kernels` layer repository route on Gemma and GPT-2; then bench-model's prediction from the
norms' own calls and its plausibility marks: tiny real models, real sweeps."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import sqlite_url
from torch import nn

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.model.bench import StepResult, benchmark, render
from fusionlab.model.models import Step
from fusionlab.model.predict import CallTiming, time_calls

HIDDEN = 64
TOKENS = 8
SHAPES = f"1x{TOKENS}x{HIDDEN},1x1x{HIDDEN}"
SMALL = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 1}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One storage with float32 rmsnorm and layernorm winners at the tiny models' shapes."""
    storage = sqlite_url(tmp_path_factory.mktemp("norms") / "norms.db")
    for op in ("rmsnorm", "layernorm"):
        sweep(op, SHAPES, "float32", storage=storage, quick=True, variants="builtin,naive",
              confirm=None)
    return storage


def _randomise(model: nn.Module) -> nn.Module:
    """Norm weights away from their ones start, so a kernel ignoring its weight is caught."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and isinstance(module.weight, torch.Tensor):
                module.weight.add_(0.3 * torch.randn(module.weight.shape, generator=generator))
    return model.eval()


def _cohere() -> nn.Module:
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    config = CohereConfig(vocab_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=128,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _randomise(CohereForCausalLM(config))


class _BiasFree(nn.Module):
    """Embedding, a bias-free nn.LayerNorm, a projection back to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


class ScaleNorm(nn.Module):
    """A norm by its weight and eps, by no name fusionlab knows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / (x.norm(dim=-1, keepdim=True) + self.eps)


class HeadRMSNorm(nn.Module):
    """An RMSNorm with a 2-D weight, one row per head."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, HIDDEN // 4))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unflatten(-1, (4, HIDDEN // 4))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return h.flatten(-2)


class _Mixed(nn.Module):
    """One replaceable LayerNorm among norm-like modules fusionlab cannot replace."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.scale = ScaleNorm()
        self.heads = HeadRMSNorm()
        self.plain = nn.LayerNorm(HIDDEN, elementwise_affine=False)
        self.unused = nn.RMSNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(self.heads(self.scale(self.norm(x))))


def _logits(model: nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [step.run() for step in causal_lm_steps(model, TOKENS)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cohere_layernorm_without_bias_is_captured_and_patched(url: str) -> None:
    model = _cohere()
    norms = {p for p, m in model.named_modules() if type(m).__name__ == "CohereLayerNorm"}
    found = capture(model, causal_lm_steps(model, TOKENS), repeats=2)
    assert {c.path for c in found.calls} == norms and len(norms) == 3
    assert {(c.op, c.casting) for c in found.calls} == {("layernorm", "none")}
    assert found.skipped == []
    reference = _logits(model)
    handle = patch(model, found, storage=url)
    assert {r.match for r in handle.rows} == {"exact"} and len(handle.rows) == 6
    assert "not patched" not in handle.report()
    _close(_logits(model), reference)
    handle.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_layernorm_without_bias_is_patched_with_a_zero_bias(url: str) -> None:
    model = _randomise(_BiasFree())
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    found = capture(model, ids, repeats=2)
    assert [(c.path, c.op) for c in found.calls] == [("norm", "layernorm")]
    with torch.no_grad():
        reference = model(ids)
    handle = patch(model, found, storage=url)
    assert [r.match for r in handle.rows] == ["exact"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference, atol=1e-5, rtol=1e-5)
    handle.undo()


def test_norm_like_modules_not_recognised_are_listed_with_why(url: str, tmp_path: Path) -> None:
    model = _randomise(_Mixed())
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    found = capture(model, x, repeats=2)
    assert [c.path for c in found.calls if c.source == "module"] == ["norm"]
    why = {s.path: s.why for s in found.skipped}
    assert set(why) == {"scale", "heads", "plain", "unused"}
    assert "neither nn.RMSNorm, nn.LayerNorm" in why["scale"]
    assert "2-D (4, 16)" in why["heads"]
    assert "no weight" in why["plain"]
    assert why["unused"] == "not called by the captured steps"
    found.save(tmp_path / "capture.json")
    loaded = type(found).load(tmp_path / "capture.json")
    assert loaded.skipped == found.skipped
    report = patch(model, loaded, storage=url).report()
    for path in ("scale (ScaleNorm)", "heads (HeadRMSNorm)", "plain (LayerNorm)",
                 "unused (RMSNorm)"):
        assert f"not patched: {path}: " in report


def test_a_capture_with_no_replaceable_norm_names_the_first_skip() -> None:
    model = nn.Sequential(ScaleNorm())
    found = capture(model, torch.randn(2, HIDDEN), repeats=2)
    with pytest.raises(UserError, match=r"no replaceable norm .*not recognised: 0 \(ScaleNorm\)"):
        patch(model, found, storage="sqlite:///unused.db")


def _gpt2() -> nn.Module:
    return tiny_model("gpt2-tiny", overrides={"n_embd": HIDDEN, "n_layer": 1})


def _gemma() -> nn.Module:
    return tiny_model("gemma-tiny", overrides=SMALL)


@pytest.mark.parametrize(("make", "norm_class"), [(_gemma, "GemmaRMSNorm"),
                                                  (_gpt2, "LayerNorm")])
def test_the_kernels_route_replaces_every_norm(make, norm_class: str, url: str,
                                               tmp_path: Path) -> None:
    """Gemma's norms carry no kernel layer name and nn.LayerNorm is no kernel layer: both are
    reached, every norm runs the repository's layer, the logits stay, nothing is left on the
    classes."""
    from fusionlab.model.hub import kernelize_norms, write_layer_repository

    model = make()
    norms = [m for m in model.modules() if type(m).__name__ == norm_class]
    reference = _logits(model)
    repo = write_layer_repository(tmp_path / "repo", storage=url)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a key that falls back would warn
            assert kernelize_norms(model, repo) == []
            got = _logits(model)
        assert norms and all("_fusionlab_entry" in m.__dict__ for m in norms)
        _close(got, reference)
        assert not hasattr(type(norms[0]), "kernel_layer_name")
    finally:
        for module in norms:
            for attribute in ("forward", "_fusionlab_entry", "_kernel_repo"):
                module.__dict__.pop(attribute, None)


def test_the_kernels_route_names_the_modules_it_cannot_reach(url: str, tmp_path: Path) -> None:
    from fusionlab.model.hub import kernelize_norms, write_layer_repository

    model = _Mixed()
    repo = write_layer_repository(tmp_path / "repo", storage=url)
    try:
        skipped = {s.path: s.why for s in kernelize_norms(model, repo)}
        assert set(skipped) == {"scale", "heads", "plain"}
        assert "_kernel_repo" in model.norm.__dict__ and "_kernel_repo" in model.unused.__dict__
    finally:
        for module in (model.norm, model.unused):
            for attribute in ("forward", "_fusionlab_entry", "_kernel_repo"):
                module.__dict__.pop(attribute, None)


def test_the_prediction_comes_from_the_norms_calls_timed_in_this_run(url: str) -> None:
    model = tiny_model("llama-tiny", overrides=SMALL)
    steps = causal_lm_steps(model, TOKENS)
    found = capture(model, steps, repeats=2)
    handle = patch(model, found, storage=url)
    results = benchmark(handle, steps, runs=3)
    assert [r.step for r in results] == ["prefill", "decode"]
    for result in results:
        captured = [c for c in found.calls if c.step == result.step]
        (group,) = result.calls  # three LlamaRMSNorm modules, one key, one variant: timed once
        assert group.calls == sum(c.calls for c in captured) == 3
        assert group.own_us > 0 and group.patched_us > 0
        assert result.norm_ms == pytest.approx(3 * group.own_us / 1e3)
        assert result.predicted_saving_ms == pytest.approx(3 * group.saving_us / 1e3)
        assert result.norm_share == pytest.approx(result.norm_ms / result.unpatched_ms)
        assert result.argmax_agreement == 1.0
    assert "of 2 rows: predicted gain inside the measured 95% interval" in render(results, handle)
    assert _patched_anywhere(model)
    handle.undo()


class _SlowInSituRMSNorm(nn.RMSNorm):
    """An RMSNorm whose own forward costs 3 ms more when its model has just run its projection
    (as a norm after a matmul meets cold caches), and nothing extra when called on its own."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _SlowInSituRMSNorm.armed:
            end = time.perf_counter() + 0.003
            while time.perf_counter() < end:
                pass
        return super().forward(x)


class _ProjectionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm = _SlowInSituRMSNorm(HIDDEN, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SlowInSituRMSNorm.armed = True
        try:
            return self.norm(self.proj(x))
        finally:
            _SlowInSituRMSNorm.armed = False


def test_the_prediction_times_each_norm_call_inside_the_running_step(url: str) -> None:
    """A cost the norm pays only inside the model is in the prediction; the isolated call,
    as the training prediction times it, does not see it."""
    model = _randomise(_ProjectionModel())
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(5))
    steps = [Step("prefill", lambda: model(x))]
    handle = patch(model, capture(model, steps, repeats=2), storage=url)
    (result,) = benchmark(handle, steps, runs=5)
    (group,) = result.calls
    assert group.calls == 1 and group.variant != "(unpatched)"
    assert group.own_us > 3000 and group.saving_us > 2500
    assert result.predicted_saving_ms > 2.5
    (isolated,) = time_calls(handle, "prefill", rounds=3)
    assert isolated.own_us < 1000
    handle.undo()


def _patched_anywhere(model: nn.Module) -> bool:
    return any("forward" in m.__dict__ for m in model.modules())


def test_implausible_figures_are_marked_not_printed_plain(url: str) -> None:
    model = _randomise(_BiasFree())
    handle = patch(model, capture(model, torch.arange(TOKENS).unsqueeze(0), repeats=2),
                   storage=url)
    handle.undo()
    plausible = StepResult("prefill", 2.0, 1.9, 1.05, 1.01, 1.09, 0.08, 0.2, 0.0, 1.0, 20)
    share = StepResult("decode", 1.0, 0.99, 1.01, 0.98, 1.04, 0.01, 10.073, 0.0, 1.0, 20)
    ratio = StepResult("prefill", 41.5, 0.02, 2075.29, 1900.0, 2200.0, 0.03, 0.4, 0.0, 1.0, 20)
    saving = StepResult("decode", 1.0, 0.5, 2.0, 1.8, 2.2, 0.01, 0.17, 0.0, 1.0, 20)
    absurd_call = CallTiming("LlamaRMSNorm", "1x32x1024 float32", "cpp", 9, 4716.0, 10.0, 4706.0)
    calls = StepResult("prefill", 2000.0, 1900.0, 1.05, 0.9, 1.2, 42.4, 42.4, 0.0, 1.0, 20,
                       (absurd_call,))
    assert plausible.problems() == {}
    text = render([plausible, share, ratio, saving, calls], handle)
    lines = text.splitlines()
    assert "[disturbed]" not in lines[2]  # the plausible row, below the header and its rule
    assert "1007.3% [disturbed]" in lines[3]
    assert "2075.290x [1900.000, 2200.000] [disturbed]" in lines[4]
    assert "2.000x [1.800, 2.200] [disturbed]" in lines[5]
    assert "42.4000 ms -> 1.0217x [disturbed]" in lines[6]
    assert "LlamaRMSNorm at 1x32x1024 float32: own/patched 471.6x is beyond 100x" in text
    assert "disturbed: decode: norms' share 1007.3% is above 100% of the step" in text
    assert "disturbed: prefill: measured gain 2075x is beyond 100x" in text
    assert "measured saving (at least) 0.4444 ms is more than the norms' whole time" in text
    assert "run again on a quiet machine" in text

"""Any model from the command line: a save_pretrained folder (config only, or with its weights),
module:function factories with their example inputs, --config typed from the config class, several
--tokens; and each bad input as one line, exit code 2, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import PLUGINS
from transformers import LlamaConfig, LlamaForCausalLM

from fusionlab.cli import main
from fusionlab.commands.model_recipe import model_from_recipe
from fusionlab.model.capture import Capture

CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}
FACTORIES = PLUGINS / "model_factories.py"


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LlamaForCausalLM]:
    """A tiny Llama saved with its weights, and its config saved alone."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, rms_norm_eps=1e-5))
    with torch.no_grad():  # norm weights away from their initial ones, to be recognisable
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape))
    model.save_pretrained(root / "with-weights")
    model.config.save_pretrained(root / "config-only")
    return root / "with-weights", root / "config-only", model


def _captured(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str]) -> Capture:
    monkeypatch.chdir(tmp_path)
    code, _, err = _main(["capture", *argv, "-o", "cap.json"], capsys)
    assert code == 0, err[-2000:]
    return Capture.load(tmp_path / "cap.json")


def test_a_folder_with_weights_is_captured_with_those_weights(saved, tmp_path, monkeypatch,
                                                                capsys) -> None:
    folder, _, model = saved
    found = _captured(["--model", str(folder), "--tokens", "4"], tmp_path, monkeypatch, capsys)
    assert found.recipe["model"] == str(folder.resolve())
    assert {(c.step, c.module_class, c.shape, c.eps) for c in found.calls} == {
        ("prefill", "LlamaRMSNorm", (1, 4, 32), 1e-5), ("decode", "LlamaRMSNorm", (1, 1, 32), 1e-5)
    }
    rebuilt, steps = model_from_recipe(found.recipe)
    saved_state = model.state_dict()
    assert rebuilt.state_dict().keys() == saved_state.keys()
    assert all(torch.equal(t, saved_state[name]) for name, t in rebuilt.state_dict().items())
    with torch.no_grad():
        expected = model(_prompt(found, 4), use_cache=False).logits
        assert torch.equal(steps[0].run(), expected)


def _prompt(found: Capture, tokens: int) -> torch.Tensor:
    """The token ids causal_lm_steps draws for the recipe's seed."""
    generator = torch.Generator().manual_seed(found.recipe["seed"])
    return torch.randint(0, CONFIG["vocab_size"], (1, tokens), generator=generator)


def test_a_config_only_folder_gets_random_weights_and_typed_overrides(saved, tmp_path,
                                                                       monkeypatch, capsys) -> None:
    _, folder, model = saved
    found = _captured(["--model", str(folder), "--tokens", "4",
                       "--config", "rms_norm_eps=0.0001,tie_word_embeddings=false"],
                      tmp_path, monkeypatch, capsys)
    assert found.recipe["config"] == {"rms_norm_eps": 1e-4, "tie_word_embeddings": False}
    assert {c.eps for c in found.calls} == {1e-4}
    rebuilt, _ = model_from_recipe(found.recipe)
    assert rebuilt.lm_head.weight is not rebuilt.model.embed_tokens.weight
    weight = rebuilt.model.embed_tokens.weight
    assert weight.shape == model.model.embed_tokens.weight.shape
    assert not torch.equal(weight, model.model.embed_tokens.weight)


def test_a_factory_file_with_its_inputs_and_typed_keywords(tmp_path, monkeypatch, capsys) -> None:
    found = _captured(["--model", f"{FACTORIES}:normed_mlp", "--config", "hidden=16,eps=0.001",
                       "--inputs", f"{FACTORIES}:mlp_inputs"], tmp_path, monkeypatch, capsys)
    assert sorted((c.path, c.op, c.shape, c.eps, c.step) for c in found.calls) == [
        ("ln", "layernorm", (3, 5, 16), 0.001, "forward"),
        ("rms", "rmsnorm", (3, 5, 16), 0.001, "forward"),
    ]
    assert found.recipe["inputs"] == f"{FACTORIES.resolve()}:mlp_inputs"
    assert found.recipe["dtype"] is None  # a factory's model keeps its own dtype


def test_a_module_factory_of_a_causal_lm_at_several_lengths(tmp_path, monkeypatch,
                                                             capsys) -> None:
    shutil.copy(FACTORIES, tmp_path / "my_models.py")
    found = _captured(["--model", "my_models:llama", "--tokens", "4,6", "--dtype", "bfloat16",
                       "--config", "hidden_size=16,rms_norm_eps=2.5e-5,tie=false"],
                      tmp_path, monkeypatch, capsys)
    assert [s.name for s in found.steps] == ["prefill@4", "decode@4", "prefill@6", "decode@6"]
    assert {(c.step, c.shape) for c in found.calls} == {
        ("prefill@4", (1, 4, 16)), ("decode@4", (1, 1, 16)),
        ("prefill@6", (1, 6, 16)), ("decode@6", (1, 1, 16)),
    }
    assert {(c.dtype, c.eps) for c in found.calls} == {("bfloat16", 2.5e-5)}
    assert found.recipe["config"] == {"hidden_size": 16, "rms_norm_eps": 2.5e-5, "tie": False}


BIG = "hidden_size=1024,num_hidden_layers=100000"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "llama-tiny", "--config", "hidden_size=-4"], "negative dimension -4"),
        (["--model", "llama-tiny", "--config", "hidden_sise=1024"], "did you mean hidden_size?"),
        (["--model", "llama-tiny", "--config", "rms_norm_eps=small"], "rms_norm_eps takes float"),
        (["--model", "llama-tiny", "--config", "hidden_size"], "write NAME=VALUE"),
        (["--model", "llama-tiny", "--config", BIG], "weights need about"),
        (["--model", "llama-tiny", "--tokens", "1000000000"], "max_position_embeddings (2048)"),
        (["--model", "llama-tiny", "--tokens", "1000000000", "--config",
          "max_position_embeddings=2000000000"], "choose fewer tokens"),
        (["--model", "llama-tiny", "--tokens", "8,0"], "at least 1"),
        (["--model", "llama-tiny", "-o", "/no/such/folder/cap.json"], "does not exist"),
        (["--model", str(PLUGINS)], "has no config.json"),
        (["--model", "models/qwen3"], "no such folder"),
        (["--model", f"{FACTORIES}:raises"], "RuntimeError: the checkpoint server is down"),
        (["--model", f"{FACTORIES}:not_a_module"], "returned int, not a torch.nn.Module"),
        (["--model", f"{FACTORIES}:missing"], "has no function 'missing'"),
        (["--model", f"{FACTORIES}:normed_mlp", "--config", "hiden=8"], "did you mean hidden?"),
        (["--model", f"{FACTORIES}:normed_mlp"], "give --inputs module:function"),
        (["--model", "no_such_module:build"], "No module named 'no_such_module'"),
        (["--model", "nope"], "unknown model 'nope'"),
    ],
)
def test_bad_model_input_is_one_line_exit_2_nothing_written(argv, says, tmp_path, monkeypatch,
                                                            capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _main(["capture", *argv], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusionlab: ") and says in lines[0], err
    assert out == ""
    assert list(tmp_path.iterdir()) == []


def test_weights_that_do_not_fit_the_config_are_one_line(saved, tmp_path, monkeypatch,
                                                         capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _main(["capture", "--model", str(saved[0]), "--config", "hidden_size=64"],
                           capsys)
    assert code == 2 and out == "" and list(tmp_path.iterdir()) == []
    assert err.count("\n") == 1 and "weights do not have the sizes --config sets" in err, err

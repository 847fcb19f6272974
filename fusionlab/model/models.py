"""Small transformers models made from a config with random weights (no download), and the steps
(prefill, decode) a causal LM is timed and captured at."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError

# name -> (transformers config class, model class, config kwargs); small enough for CI.
_TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-tiny": ("LlamaConfig", "LlamaForCausalLM", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    }),
    "gemma-tiny": ("GemmaConfig", "GemmaForCausalLM", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
    }),
    "gpt2-tiny": ("GPT2Config", "GPT2LMHeadModel", {
        "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 512,
    }),
}
MODEL_NAMES = tuple(_TINY)


def parse_overrides(text: str | None) -> dict[str, int]:
    """`hidden_size=1024,num_hidden_layers=4` -> config overrides (integers)."""
    overrides: dict[str, int] = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        try:
            overrides[name.strip()] = int(value)
        except ValueError:
            raise UserError(
                f"--config {item!r}: write NAME=INTEGER, e.g. hidden_size=1024"
            ) from None
    return overrides


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               overrides: dict[str, int] | None = None) -> nn.Module:
    """A named small transformers model with random weights, in eval mode."""
    if name not in _TINY:
        raise UserError(f"unknown model {name!r}: choose from {', '.join(MODEL_NAMES)}")
    import transformers

    config_name, model_name, kwargs = _TINY[name]
    try:
        config = getattr(transformers, config_name)(**{**kwargs, **(overrides or {})})
    except (TypeError, ValueError) as error:
        raise UserError(f"model {name}: bad --config ({error})") from None
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    _randomise_norm_weights(model, seed)
    return model


def _randomise_norm_weights(model: nn.Module, seed: int) -> None:
    """Norm weights start at ones (or zeros with Gemma's `1 + weight`): that would hide a kernel
    that ignores its weight, so give them values around their start."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() or name.split(".")[-2].startswith("ln"):
                noise = 0.2 * torch.randn(parameter.shape, generator=generator)
                parameter.add_(noise.to(parameter.dtype))


@dataclass
class Step:
    """One timed call of a model: prefill (the whole prompt) or decode (one token, cache kept)."""

    name: str
    run: Callable[[], torch.Tensor]  # returns the logits


def causal_lm_steps(model: nn.Module, tokens: int, seed: int = 0) -> list[Step]:
    """Prefill of `tokens` tokens and one decode step that reuses (then crops) the KV cache."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=generator)
    next_id = torch.randint(0, vocab, (1, 1), generator=generator)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # transformers 5 / 4

    def prefill() -> torch.Tensor:
        return model(ids, use_cache=False).logits

    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else (
        "past_key_values"
    )

    def decode() -> torch.Tensor:
        logits = model(next_id, use_cache=True, **{cache_argument: cache}).logits
        cache.crop(-1)  # back to the prompt, so every decode call does the same work
        return logits

    return [Step("prefill", prefill), Step("decode", decode)]


def module_steps(model: nn.Module, example_inputs: Any) -> list[Step]:
    """One step that calls an arbitrary module with the example inputs (a tuple, dict or tensor)."""

    def forward() -> torch.Tensor:
        if isinstance(example_inputs, dict):
            out = model(**example_inputs)
        elif isinstance(example_inputs, (tuple, list)):
            out = model(*example_inputs)
        else:
            out = model(example_inputs)
        return _logits(out)

    return [Step("forward", forward)]


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise UserError("the model's output has no tensor or .logits to compare: return a tensor")

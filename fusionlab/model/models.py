"""Small transformers models made from a config with random weights (no download), and the steps
(prefill, decode) a causal LM is timed and captured at."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.configs import check_known, config_fields

# name -> (transformers config class, config kwargs); small enough for CI.
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("LlamaConfig", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    }),
    "gemma-tiny": ("GemmaConfig", {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
    }),
    "gpt2-tiny": ("GPT2Config", {
        "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 512,
    }),
}
MODEL_NAMES = tuple(_TINY)


def tiny_config_class(name: str) -> type:
    """The transformers config class of a named small model."""
    if name not in _TINY:
        raise UserError(f"unknown model {name!r}: choose from {', '.join(MODEL_NAMES)}")
    import transformers

    return getattr(transformers, _TINY[name][0])


def tiny_config(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """A named small model's config with overrides; a name the config does not have is refused."""
    config_class = tiny_config_class(name)
    check_known(overrides or {}, config_fields(config_class), config_class.__name__)
    try:
        with quiet_transformers():
            return config_class(**{**_TINY[name][1], **(overrides or {})})
    except Exception as error:  # transformers validates the config's fields and architecture
        text = " ".join(str(error).split())[:300]
        raise UserError(f"model {name}: bad --config ({text})") from None


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               overrides: dict[str, Any] | None = None) -> nn.Module:
    """A named small transformers model with random weights, in eval mode."""
    return random_causal_lm(tiny_config(name, overrides), dtype, seed)


def random_causal_lm(config: Any, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """The causal LM a transformers config describes, random weights (norm weights too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:  # a config without a causal LM, or sizes no model can have
        text = " ".join(str(error).split())[:300]
        raise UserError(
            f"no causal LM can be made from this {type(config).__name__} ({type(error).__name__}:"
            f" {text}): fix --config, or give module:function for other models"
        ) from None
    model = model.to(dtype).eval()
    _randomise_norm_weights(model, seed)
    return model


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own notices (token ids beyond a tiny vocabulary...) and progress bars kept
    off stderr."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


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


def causal_lm_steps_at(model: nn.Module, lengths: list[int], seed: int = 0) -> list[Step]:
    """Prefill and decode at each prompt length; with several, each step is named `prefill@N`."""
    if len(lengths) == 1:
        return causal_lm_steps(model, lengths[0], seed)
    return [Step(f"{step.name}@{n}", step.run) for n in lengths
            for step in causal_lm_steps(model, n, seed)]


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

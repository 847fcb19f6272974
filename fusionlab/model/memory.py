"""Whether a transformers model and its prefill steps fit in host memory, estimated before anything
is allocated: the weights by building the model on the `meta` device (one and two layers, then
extrapolated, so a 100000-layer config costs two tiny builds), the steps from the config."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fusionlab.devices import get_device
from fusionlab.errors import UserError
from fusionlab.plan import _human


def weight_bytes(config: Any, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters and buffers in `dtype`."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 2:
        return _meta_bytes(config, dtype)
    one, two = (_meta_bytes(_with_layers(config, n), dtype) for n in (1, 2))
    return one + (layers - 1) * (two - one)


def _with_layers(config: Any, layers: int) -> Any:
    smaller = copy.deepcopy(config)
    smaller.num_hidden_layers = layers
    return smaller


def _meta_bytes(config: Any, dtype: torch.dtype) -> int:
    from transformers import AutoModelForCausalLM

    from fusionlab.model.models import quiet_transformers

    try:
        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:  # a config no model can be made from (a negative size...)
        text = " ".join(str(error).split())[:300]
        raise UserError(
            f"no model can be made from this config ({type(error).__name__}: {text}): fix --config"
        ) from None
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
               for t in tensors)


def check_weights_fit(config: Any, dtype: torch.dtype) -> None:
    """Refuse a model whose weights alone exceed the memory available, before building it."""
    needed = weight_bytes(config, dtype)
    free = get_device("cpu").available_memory()
    if free is not None and needed > free:
        raise UserError(
            f"the model's weights need about {_human(needed)} in {str(dtype).split('.')[-1]} and "
            f"{_human(free)} of memory is available: choose a smaller --config"
        )


def step_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """At least what a prefill and a decode step of `tokens` tokens hold: the ids, the logits
    (and their float32 copy), the KV cache, the captured norm inputs and one layer's activations."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    inner = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    size = dtype.itemsize
    per_token = 16 + vocab * (size + 4) + hidden * size * (2 * layers + 2 * layers + 1 + 4)
    return tokens * (per_token + 3 * inner * size)


def check_steps_fit(config: Any, lengths: list[int], dtype: torch.dtype) -> None:
    """Refuse prompt lengths beyond the model's positions or the memory available."""
    positions = getattr(config, "max_position_embeddings", None)
    longest = max(lengths)
    if isinstance(positions, int) and longest > positions:
        raise UserError(
            f"--tokens {longest} is beyond the model's max_position_embeddings ({positions}): "
            "choose fewer tokens, or raise it with --config max_position_embeddings=N"
        )
    needed = sum(step_bytes(config, n, dtype) for n in lengths)
    free = get_device("cpu").available_memory()
    if free is not None and needed > free:
        raise UserError(
            f"--tokens {','.join(map(str, lengths))} needs at least {_human(needed)} of memory "
            f"(logits, KV cache, activations) and {_human(free)} is available: choose fewer tokens"
        )

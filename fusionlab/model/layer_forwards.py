"""The decoder-layer shapes whose residual add + norm fusionlab can fuse in eager mode, and their
fused forwards.

A layer is recognised by its forward, not by its class name: the body of its class's forward
(comments and formatting aside) must equal a known shape's, as transformers 5 writes it for
Llama, Qwen2, Qwen3, Mistral and Gemma (pre-norm) and for GPT-2's block. The fused forward is that
body with the add after the attention and the norm that follows it done by one call,
`add_norm(x, residual) -> (norm(x + residual), x + residual)`; the add after the MLP stays as it
is (it feeds the next layer, whose forward takes one tensor)."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

AddNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_PRE_NORM_BODY = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(
    hidden_states=hidden_states,
    attention_mask=attention_mask,
    position_ids=position_ids,
    cache=cache,
    use_cache=use_cache,
    position_embeddings=position_embeddings,
    **kwargs,
)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""

_GPT2_BODY = """
residual = hidden_states
hidden_states = self.ln_1(hidden_states)
attn_output, _ = self.attn(
    hidden_states,
    cache=cache,
    attention_mask=attention_mask,
    use_cache=use_cache,
    **kwargs,
)
hidden_states = attn_output + residual
if encoder_hidden_states is not None:
    if not hasattr(self, "crossattention"):
        raise ValueError(
            f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
            "cross-attention layers by setting `config.add_cross_attention=True`"
        )
    residual = hidden_states
    hidden_states = self.ln_cross_attn(hidden_states)
    cross_attn_output, _ = self.crossattention(
        hidden_states,
        cache=cache,
        attention_mask=attention_mask,
        encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask,
    )
    hidden_states = residual + cross_attn_output
residual = hidden_states
hidden_states = self.ln_2(hidden_states)
feed_forward_hidden_states = self.mlp(hidden_states)
hidden_states = residual + feed_forward_hidden_states
return hidden_states
"""


@dataclass(frozen=True)
class LayerShape:
    """A known decoder-layer shape: its forward's parameters and body, the norm the fused add
    feeds, the fused op, and its forward with that add + norm as one call."""

    name: str
    parameters: tuple[str, ...]
    body: str
    norm: str  # the attribute of the norm after the attention's residual add
    op: str
    make_forward: Callable[[nn.Module, AddNorm, Callable[..., Any]], Callable[..., Any]]


def _pre_norm_forward(layer: nn.Module, add_norm: AddNorm,
                      original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                use_cache: bool | None = False, position_embeddings: Any = None,
                **kwargs: Any) -> torch.Tensor:
        cache = kwargs.pop("past_key_values", cache)  # the old name the layer still accepts
        residual = hidden_states
        hidden_states = layer.input_layernorm(hidden_states)
        hidden_states, _ = layer.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs,
        )
        hidden_states, residual = add_norm(hidden_states, residual)
        return residual + layer.mlp(hidden_states)

    return forward


def _gpt2_forward(layer: nn.Module, add_norm: AddNorm,
                  original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(hidden_states: torch.Tensor, cache: Any = None,
                attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                use_cache: bool | None = False, **kwargs: Any) -> torch.Tensor:
        if encoder_hidden_states is not None:  # cross-attention: the block's own forward
            return original(hidden_states, cache, attention_mask, encoder_hidden_states,
                            encoder_attention_mask, use_cache, **kwargs)
        cache = kwargs.pop("past_key_values", cache)  # the old name the block still accepts
        residual = hidden_states
        attn_output, _ = layer.attn(layer.ln_1(hidden_states), cache=cache,
                                    attention_mask=attention_mask, use_cache=use_cache, **kwargs)
        hidden_states, residual = add_norm(attn_output, residual)
        return residual + layer.mlp(hidden_states)

    return forward


SHAPES = (
    LayerShape(
        "pre-norm (Llama, Qwen2, Qwen3, Mistral, Gemma)",
        ("self", "hidden_states", "attention_mask", "position_ids", "cache", "use_cache",
         "position_embeddings", "**kwargs"),
        _PRE_NORM_BODY, "post_attention_layernorm", "add_rmsnorm", _pre_norm_forward,
    ),
    LayerShape(
        "GPT-2 block",
        ("self", "hidden_states", "cache", "attention_mask", "encoder_hidden_states",
         "encoder_attention_mask", "use_cache", "**kwargs"),
        _GPT2_BODY, "ln_2", "add_layernorm", _gpt2_forward,
    ),
)


def shape_of(layer: nn.Module) -> LayerShape | None:
    """The known shape whose forward the layer's class has, or None."""
    found = _forward_of(type(layer))
    if found is None:
        return None
    parameters, body = found
    for shape in SHAPES:
        if parameters == shape.parameters and body == _dump(ast.parse(shape.body).body):
            return shape
    return None


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that are decoder layers: a known shape, or a class named *DecoderLayer/*Block
    that owns a norm (those are reported as not fused)."""
    found = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if shape_of(module) is not None or name.endswith(("DecoderLayer", "Block")):
            found.append((path, module))
    return found


@functools.cache
def _forward_of(cls: type) -> tuple[tuple[str, ...], str] | None:
    """The class's forward: its parameter names and its body (docstring dropped) as an AST dump."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = function.args
    parameters = [a.arg for a in (*args.posonlyargs, *args.args)]
    parameters += [f"*{args.vararg.arg}"] if args.vararg else []
    parameters += [a.arg for a in args.kwonlyargs]
    parameters += [f"**{args.kwarg.arg}"] if args.kwarg else []
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return tuple(parameters), _dump(body)


def _dump(statements: list[ast.stmt]) -> str:
    return "\n".join(ast.dump(statement) for statement in statements)

"""How capture and bench-model make their model: the recipe from the command line (else the
capture's own), the model it builds and the steps it is run at."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.configs import split_items
from fusionlab.model.memory import check_steps_fit
from fusionlab.model.models import Step, causal_lm_steps_at, module_steps
from fusionlab.model.sources import FactorySource, example_inputs, open_source
from fusionlab.plan import check_thread_count
from fusionlab.shapes import DTYPES, parse_dtype


def set_threads(threads: int | None) -> None:
    if threads is not None:
        check_thread_count(threads)
        torch.set_num_threads(threads)


def _tokens(text: str) -> list[int]:
    """`--tokens 128` or `--tokens 16,128`: prompt lengths, each at least 1."""
    try:
        lengths = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        lengths = []
    if not lengths:
        raise UserError(f"--tokens {text!r}: write prompt lengths, e.g. 128 or 16,128")
    if min(lengths) < 1:
        raise UserError(f"--tokens must be at least 1 (got {min(lengths)})")
    return list(dict.fromkeys(lengths))


def recipe_of(args: argparse.Namespace, stored: dict[str, Any]) -> dict[str, Any]:
    """How to make the model: each setting from the command line, else from the capture's recipe
    (bench-model), else its default."""
    spec = args.model or stored.get("model")
    if not spec:
        raise UserError(
            f"{args.capture} was captured from Python and does not say how to make the model: "
            "give --model (a preset, a folder or module:function), with the --config, --tokens "
            "or --inputs it was captured with"
        )
    source = open_source(spec)
    stored_tokens = stored.get("tokens", 128)
    dtype = args.dtype or stored.get("dtype")
    if dtype is None and not isinstance(source, FactorySource):
        dtype = "float32"
    return {
        "model": source.spec,
        "config": source.typed(split_items(args.config)) if args.config is not None
        else dict(stored.get("config") or {}),
        "dtype": None if dtype is None else parse_dtype(dtype),
        "tokens": _tokens(args.tokens) if args.tokens is not None
        else ([stored_tokens] if isinstance(stored_tokens, int) else list(stored_tokens)),
        "seed": args.seed if args.seed is not None else int(stored.get("seed", 0)),
        "inputs": args.inputs or stored.get("inputs"),
    }


def model_from_recipe(recipe: dict[str, Any]) -> tuple[torch.nn.Module, list[Step]]:
    """The model a recipe describes and the steps to capture or time it at."""
    dtype = None if recipe["dtype"] is None else DTYPES[recipe["dtype"]]
    model = open_source(recipe["model"]).build(recipe["config"], dtype, recipe["seed"])
    if recipe.get("inputs"):
        return model, module_steps(model, example_inputs(recipe["inputs"], model))
    config = getattr(model, "config", None)
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise UserError(
            f"--model {recipe['model']} made a {type(model).__name__}, not a transformers causal "
            "LM: give --inputs module:function for its example inputs"
        )
    parameter = next(model.parameters(), None)
    check_steps_fit(config, recipe["tokens"], parameter.dtype if parameter is not None
                    else torch.float32)
    try:
        return model, causal_lm_steps_at(model, recipe["tokens"], recipe["seed"])
    except Exception as error:  # the model's own code may raise anything
        text = " ".join(str(error).split())[:200]
        raise UserError(
            f"the model's first prefill failed ({type(error).__name__}: {text}): give "
            "--inputs module:function if it is not a causal LM taking token ids"
        ) from None


def steps_of(recipe: dict[str, Any]) -> Callable[[nn.Module], list[Step]]:
    """How to make the recipe's steps for one copy of its model."""
    if recipe.get("inputs"):
        return lambda model: module_steps(model, example_inputs(recipe["inputs"], model))
    return lambda model: causal_lm_steps_at(model, recipe["tokens"], recipe["seed"])

"""The `capture` and `bench-model` commands, and the shapes `sweep --from-capture` measures."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.bench import benchmark, render
from fusionlab.model.candidates import FusionCandidate
from fusionlab.model.capture import Capture, capture
from fusionlab.model.configs import split_items
from fusionlab.model.fusion_bench import Patching, measure_fusion
from fusionlab.model.fusion_table import render_fusion
from fusionlab.model.memory import check_steps_fit
from fusionlab.model.models import Step, causal_lm_steps_at, module_steps
from fusionlab.model.patch import patch
from fusionlab.model.sources import FactorySource, example_inputs, open_source
from fusionlab.model.train import check_lengths, trainable_parameters
from fusionlab.model.train_bench import benchmark_training, gradient_warnings, render_training
from fusionlab.plan import check_thread_count, load_user_variants
from fusionlab.plausible import marked, share_problem
from fusionlab.registry import get_op
from fusionlab.report.export import check_writable
from fusionlab.search.storage import DEFAULT_STORAGE
from fusionlab.shapes import DTYPES, format_shape, parse_dtype


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _set_threads(threads: int | None) -> None:
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


def _recipe(args: argparse.Namespace, stored: dict[str, Any]) -> dict[str, Any]:
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


def _model_from_recipe(recipe: dict[str, Any]) -> tuple[torch.nn.Module, list[Step]]:
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


def capture_command(args: argparse.Namespace) -> int:
    load_user_variants(args.plugin)
    _set_threads(args.threads)
    check_writable(args.output)
    recipe = _recipe(args, {})
    model, steps = _model_from_recipe(recipe)
    found = capture(model, steps, name=args.model, recipe=recipe, candidates=True)
    try:
        found.save(args.output)
    except OSError as error:
        raise UserError(f"cannot write {args.output!r}: {error.strerror or error}") from None
    for step in found.steps:
        share = marked(f"{100 * step.share:.1f}%", share_problem(step.share))
        _say(f"{step.name}: {step.step_ms:.3f} ms per step, norms {step.norm_ms:.4f} ms ({share})")
    rows = [(c.step, c.path, c.module_class, c.op, c.key, c.calls, c.casting, f"{c.offset:g}",
             f"{c.call_us:.1f}") for c in found.calls]
    print(tabulate(rows, headers=["step", "module", "class", "op", "key", "calls", "casting",
                                  "offset", "us/call"], tablefmt="simple"))
    for line in found.skip_lines():
        _say(line)
    _print_candidates(found)
    ops = sorted({c.op for c in found.calls} | {c.op for c in found.candidates})
    _say(f"wrote {args.output} ({len(found.calls)} keys, {len(found.candidates)} fusion "
         "candidates); next: "
         + "; ".join(f"fusionlab sweep {op} --from-capture {args.output}" for op in ops))
    return 0


def _print_candidates(found: Capture) -> None:
    """The fusion candidates, one row per step, chain and key, with their count per step and the
    norms' share of the step; then one line on the norms whose chain is unknown."""
    if found.candidates:
        print()
        print(tabulate(candidate_rows(found), headers=[
            "step", "kind", "sweep op", "key", "calls", "norms' share", "chain"
        ], tablefmt="simple"))
    unknown = ", ".join(found.untraced[:4]) + (", ..." if len(found.untraced) > 4 else "")
    if found.trace_problem:
        _say(f"no fusion candidates: {found.trace_problem}; not found for {len(found.untraced)} "
             f"norm(s) ({unknown}); the norm calls above are captured from the modules")
    elif found.untraced:
        _say(f"fusion candidates not looked for at {len(found.untraced)} norm(s) the "
             f"{found.traced} graph does not call as a module ({unknown})")


def candidate_rows(found: Capture) -> list[tuple[object, ...]]:
    """The candidates grouped by step, kind, op, key and chain: calls per step summed over the
    norms, and the share of the step those norms' own timed calls take."""
    groups: dict[tuple[str, str, str, str, str], list[FusionCandidate]] = {}
    for c in found.candidates:
        groups.setdefault((c.step, c.kind, c.op, c.key, c.pattern()), []).append(c)
    step_ms = {step.name: step.step_ms for step in found.steps}
    rows = []
    for (step, kind, op, key, pattern), members in groups.items():
        norm_ms = sum(c.calls * c.call_us for c in members) / 1e3
        share = norm_ms / step_ms[step] if step_ms.get(step) else 0.0
        rows.append((step, kind, op, key, sum(c.calls for c in members),
                     marked(f"{100 * share:.1f}%", share_problem(share)), pattern))
    return rows


def capture_shapes(op: str, path: str) -> tuple[str, str, int]:
    """The shapes, dtypes and thread count a capture recorded for an op (its norm calls, or the
    fusion candidates it computes), as sweep arguments."""
    get_op(op)
    found = Capture.load(path)
    keys = found.keys_of(op)
    if not keys:
        held = ", ".join(sorted({c.op for c in [*found.calls, *found.candidates]}))
        why = (f"; no fusion candidates were found: {found.trace_problem}" if found.trace_problem
               else "; fusion candidates were not looked for: capture(..., candidates=True)"
               if found.calls and not found.traced else "")
        raise UserError(f"capture {path!r} records no {op} calls (it holds "
                        f"{held or 'no norm calls'}){why}")
    shapes = sorted({shape for shape, _ in keys}, key=lambda s: (s[-1], len(s), s))
    dtypes = sorted({dtype for _, dtype in keys})
    return ",".join(format_shape(s) for s in shapes), ",".join(dtypes), found.threads


def _steps_of(recipe: dict[str, Any]) -> Callable[[nn.Module], list[Step]]:
    """How to make the recipe's steps for one copy of its model."""
    if recipe.get("inputs"):
        return lambda model: module_steps(model, example_inputs(recipe["inputs"], model))
    return lambda model: causal_lm_steps_at(model, recipe["tokens"], recipe["seed"])


def bench_model_command(args: argparse.Namespace) -> int:
    load_user_variants(args.plugin)
    found = Capture.load(args.capture)
    recipe = _recipe(args, found.recipe)
    _set_threads(args.threads if args.threads is not None else found.threads)
    if args.runs < 2:
        raise UserError(f"--runs must be at least 2 (got {args.runs})")
    if args.train and recipe["inputs"]:
        raise UserError(
            f"{args.capture} times the model on --inputs {recipe['inputs']}, not on token ids: "
            "--train times causal-LM training steps (next-token loss); bench it without --train"
        )
    if args.compile_backend is not None and (args.train or not args.fuse):
        raise UserError("--compile-backend chooses the compiler of the six --fuse configurations: "
                        "give it with --fuse and without --train, or leave it out")
    if args.train:
        check_lengths(recipe["tokens"])
    model, steps = _model_from_recipe(recipe)
    if args.train:
        trainable_parameters(model)
    ops = args.ops.split(",") if args.ops else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patch(model, found, storage=args.storage, winners=args.winners, ops=ops,
                       mode="training" if args.train else "inference", fuse=args.fuse)
    for warning in caught:
        if str(warning.message).startswith("fusionlab"):
            _say(f"warning: {warning.message}")
    print(handle.report())
    print()
    if args.fuse and not args.train:
        handle.undo()
        storage = args.storage or DEFAULT_STORAGE if args.winners is None else None
        result = measure_fusion(model, _steps_of(recipe),
                                Patching(found, storage, args.winners, ops), args.runs,
                                args.compile_backend or "inductor", say=_say)
        print(render_fusion(result))
        return 0
    if not args.train:
        print(render(benchmark(handle, steps, args.runs), handle))
        return 0
    results = benchmark_training(handle, recipe["tokens"], args.runs, recipe["seed"])
    print(render_training(results))
    differ = gradient_warnings(results)
    for line in differ:
        _say(f"warning: {line}")
    return 1 if differ else 0


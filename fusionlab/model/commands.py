"""The `capture` and `bench-model` commands, and the shapes `sweep --from-capture` measures."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import torch
from tabulate import tabulate

from fusionlab.errors import UserError
from fusionlab.model.bench import benchmark, render
from fusionlab.model.capture import Capture, capture
from fusionlab.model.models import causal_lm_steps, parse_overrides, tiny_model
from fusionlab.model.patch import patch
from fusionlab.model.plausible import marked, share_problem
from fusionlab.plan import load_user_variants
from fusionlab.registry import get_op
from fusionlab.shapes import format_shape, parse_dtypes


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be at least 1 (got {threads})")
        torch.set_num_threads(threads)


def _model_from_recipe(recipe: dict[str, Any]) -> tuple[torch.nn.Module, list[Any]]:
    (dtype,) = parse_dtypes(recipe["dtype"])
    model = tiny_model(recipe["model"], getattr(torch, dtype), recipe["seed"], recipe["config"])
    return model, causal_lm_steps(model, recipe["tokens"], recipe["seed"])


def capture_command(args: argparse.Namespace) -> int:
    load_user_variants(args.plugin)
    _set_threads(args.threads)
    if args.tokens < 1:
        raise UserError(f"--tokens must be at least 1 (got {args.tokens})")
    recipe = {"model": args.model, "config": parse_overrides(args.config), "dtype": args.dtype,
              "tokens": args.tokens, "seed": args.seed}
    model, steps = _model_from_recipe(recipe)
    found = capture(model, steps, name=args.model)
    found.recipe = recipe
    found.save(args.output)
    for step in found.steps:
        share = marked(f"{100 * step.share:.1f}%", share_problem(step.share))
        _say(f"{step.name}: {step.step_ms:.3f} ms per step, norms {step.norm_ms:.4f} ms ({share})")
    rows = [(c.step, c.path, c.module_class, c.op, c.key, c.calls, c.casting, f"{c.offset:g}",
             f"{c.call_us:.1f}") for c in found.calls]
    print(tabulate(rows, headers=["step", "module", "class", "op", "key", "calls", "casting",
                                  "offset", "us/call"], tablefmt="simple"))
    for line in found.skip_lines():
        _say(line)
    ops = sorted({c.op for c in found.calls})
    _say(f"wrote {args.output} ({len(found.calls)} keys); next: "
         + "; ".join(f"fusionlab sweep {op} --from-capture {args.output}" for op in ops))
    return 0


def capture_shapes(op: str, path: str) -> tuple[str, str, int]:
    """The shapes, dtypes and thread count a capture recorded for an op, as sweep arguments."""
    get_op(op)
    found = Capture.load(path)
    calls = found.of_op(op)
    if not calls:
        held = ", ".join(sorted({c.op for c in found.calls})) or "no norm calls"
        raise UserError(f"capture {path!r} records no {op} calls (it holds {held})")
    shapes = sorted({c.shape for c in calls}, key=lambda s: (s[-1], len(s), s))
    dtypes = sorted({c.dtype for c in calls})
    return ",".join(format_shape(s) for s in shapes), ",".join(dtypes), found.threads


def bench_model_command(args: argparse.Namespace) -> int:
    load_user_variants(args.plugin)
    found = Capture.load(args.capture)
    if not found.recipe:
        raise UserError(
            f"{args.capture} was captured from Python: benchmark it with "
            "fusionlab.patch(model, capture, ...).benchmark(steps)"
        )
    _set_threads(args.threads if args.threads is not None else found.threads)
    if args.runs < 2:
        raise UserError(f"--runs must be at least 2 (got {args.runs})")
    model, steps = _model_from_recipe(found.recipe)
    ops = args.ops.split(",") if args.ops else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patch(model, found, storage=args.storage, winners=args.winners, ops=ops)
    for warning in caught:
        if str(warning.message).startswith("fusionlab"):
            _say(f"warning: {warning.message}")
    print(handle.report())
    print()
    print(render(benchmark(handle, steps, args.runs), handle))
    return 0


"""`fusionlab bench-model`: patch a captured model with the winners and time it end to end."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from torch import nn

from fusionlab.commands.arguments import add_model_source, add_plugin
from fusionlab.commands.console import say
from fusionlab.commands.model_recipe import model_from_recipe, recipe_of, set_threads, steps_of
from fusionlab.errors import UserError
from fusionlab.model.bench import benchmark, render
from fusionlab.model.capture import Capture
from fusionlab.model.fusion_bench import Patching, measure_fusion
from fusionlab.model.fusion_table import render_fusion
from fusionlab.model.patch import PatchHandle, patch
from fusionlab.model.train import check_lengths, trainable_parameters
from fusionlab.model.train_bench import benchmark_training, gradient_warnings, render_training
from fusionlab.plan import load_user_variants
from fusionlab.search.storage import DEFAULT_STORAGE

NAME = "bench-model"
HELP = "patch a captured model with the winners and time it end to end"


def add_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--capture", required=True, help="a file written by `fusionlab capture`")
    add_model_source(bench, again=True)
    bench.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    bench.add_argument("--winners", help="a winners file (`fusionlab export OP --format json`)")
    bench.add_argument("--ops", help="comma-separated ops to patch (default: all captured)")
    bench.add_argument("--runs", type=int, default=30, help="alternating runs per step")
    bench.add_argument(
        "--fuse", action="store_true",
        help="time six configurations side by side: eager, patched, patched + fused (each "
        "decoder layer's add + norm as one add_rmsnorm / add_layernorm call), torch.compile, "
        "compile + patched, compile + the fused pass (needs the fused op's sweep results; see "
        "docs/fusion.md); with --train: training patched + fused against unpatched",
    )
    bench.add_argument(
        "--compile-backend", choices=("inductor", "eager"),
        help="the compiler of the --fuse compiled configurations (default inductor; eager runs "
        "dynamo's graphs as traced, for quick checks)",
    )
    bench.add_argument(
        "--train", action="store_true",
        help="time full training steps (forward, next-token cross-entropy, backward, AdamW) "
        "patched vs an unpatched copy, with peak memory and every parameter's gradient compared; "
        "exit code 1 when a gradient differs beyond its tolerance",
    )
    bench.add_argument("--threads", type=int, help="cpu threads (default: the capture's)")
    add_plugin(bench)


def run(args: argparse.Namespace) -> int:
    load_user_variants(args.plugin)
    found = Capture.load(args.capture)
    recipe = recipe_of(args, found.recipe)
    set_threads(args.threads if args.threads is not None else found.threads)
    _check_options(args, recipe)
    model, steps = model_from_recipe(recipe)
    if args.train:
        trainable_parameters(model)
    ops = args.ops.split(",") if args.ops else None
    handle = _patched(model, found, args, ops)
    print(handle.report())
    print()
    if args.train:
        return _train(handle, recipe, args.runs)
    if args.fuse:
        handle.undo()
        storage = args.storage or DEFAULT_STORAGE if args.winners is None else None
        result = measure_fusion(model, steps_of(recipe),
                                Patching(found, storage, args.winners, ops), args.runs,
                                args.compile_backend or "inductor", say=say)
        print(render_fusion(result))
        return 0
    print(render(benchmark(handle, steps, args.runs), handle))
    return 0


def _check_options(args: argparse.Namespace, recipe: dict[str, Any]) -> None:
    """--runs, --train and --compile-backend against each other and the recipe."""
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


def _patched(model: nn.Module, found: Capture, args: argparse.Namespace,
             ops: list[str] | None) -> PatchHandle:
    """The model patched with the winners; fusionlab's warnings said as one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patch(model, found, storage=args.storage, winners=args.winners, ops=ops,
                       mode="training" if args.train else "inference", fuse=args.fuse)
    for warning in caught:
        if str(warning.message).startswith("fusionlab"):
            say(f"warning: {warning.message}")
    return handle


def _train(handle: PatchHandle, recipe: dict[str, Any], runs: int) -> int:
    """Training steps patched against unpatched; 1 when a gradient differs."""
    results = benchmark_training(handle, recipe["tokens"], runs, recipe["seed"])
    print(render_training(results))
    differ = gradient_warnings(results)
    for line in differ:
        say(f"warning: {line}")
    return 1 if differ else 0



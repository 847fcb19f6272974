"""What the winners are worth inside a model, and whether the prediction holds: a random
transformers Llama made from its config is captured at each prompt length, its norm shapes swept,
patched, and timed patched and unpatched alternately at prefill and decode, fp32 and bf16; the
gain predicted from the norms' own calls (timed call level in the same run) beside the measured
gain and its 95% interval, and how many rows have the prediction inside the interval (target:
at least 90% on a quiet machine). Then the patched path's own cost per call at decode size: the
patched module against the chosen kernel called directly (target: within 1 us), the Dispatcher,
and the model's own module.

    python benchmarks/model_e2e.py [--hidden 1024] [--layers 4] [--tokens 32,128] [--runs 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import timeit
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from llama_args import add_llama_arguments, llama_config
from tabulate import tabulate

from fusionlab import Dispatcher, capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.model.bench import StepResult, benchmark, render
from fusionlab.model.patch import PatchHandle
from fusionlab.shapes import format_shape


def per_call_us(calls: dict[str, Callable[[], object]], loops: int = 500,
                rounds: int = 21) -> dict[str, float]:
    """Median time of one call of each, measured in interleaved rounds so that the machine's
    drift hits every path alike (the CPU runs synchronously)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    names = list(calls)
    for round_index in range(rounds):
        start = round_index % len(names)  # each path takes every place in the order in turn
        for name in names[start:] + names[:start]:
            samples[name].append(timeit.timeit(calls[name], number=loops) / loops)
    return {name: 1e6 * statistics.median(values) for name, values in samples.items()}


def overhead(model: torch.nn.Module, handle: PatchHandle, url: str) -> list[list[str]]:
    """The patched module against its chosen kernel called directly, at decode size."""
    norm = model.model.norm
    x = torch.randn(1, 1, norm.weight.shape[0], dtype=norm.weight.dtype)
    weight, eps = norm.weight, norm.variance_epsilon
    dispatcher = Dispatcher("rmsnorm", url)
    dispatcher(x, weight, eps)
    kernel = dispatcher._resolve((x, weight, eps))
    bare = copy.deepcopy(norm)  # the least any patch can cost: the module's forward is the kernel
    bare.forward = lambda x: kernel(x, weight, eps)
    own = copy.deepcopy(norm)
    own.__dict__.pop("forward", None)
    with torch.no_grad():
        us = per_call_us({
            "kernel": lambda: kernel(x, weight, eps),
            "bare": lambda: bare(x),
            "patched": lambda: norm(x),
            "dispatcher": lambda: dispatcher(x, weight, eps),
            "own": lambda: own(x),
        })
    rows = [
        ("the chosen kernel called directly", "kernel"),
        ("a module whose forward is that kernel (the floor)", "bare"),
        ("the patched module: model.norm(x)", "patched"),
        ("fusionlab.Dispatcher(x, w, eps)", "dispatcher"),
        ("the model's own module, unpatched", "own"),
    ]
    return [[label, f"{us[key]:.2f}", f"{us[key] - us['kernel']:+.2f}",
             f"{us[key] - us['bare']:+.2f}"] for label, key in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_arguments(parser, runs=20, tokens="32,128",
                        tokens_help="prompt lengths, comma-separated")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    lengths = [int(t) for t in args.tokens.split(",")]
    config = llama_config(args)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, prefill of {args.tokens} tokens and "
          f"one decode step each, {args.runs} runs, {torch.get_num_threads()} thread(s)")
    storage = tempfile.mkdtemp(prefix="fusionlab-e2e-")
    rows: list[StepResult] = []
    for dtype in ("float32", "bfloat16"):
        model = tiny_model("llama-tiny", getattr(torch, dtype), overrides=config)
        captures = {tokens: capture(model, causal_lm_steps(model, tokens)) for tokens in lengths}
        url = f"sqlite:///{Path(storage) / f'{dtype}.db'}"
        shapes = ",".join(sorted({format_shape(c.shape) for found in captures.values()
                                  for c in found.of_op("rmsnorm")}))
        sweep("rmsnorm", shapes, dtype, storage=url, quick=True, variants=args.variants)
        for tokens, found in captures.items():
            print(f"\n== {dtype}, {tokens}-token prompt")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    handle = patch(model, found, storage=url)
            except UserError as error:
                print(f"not patched: {error}")
                continue
            chosen = sorted({(r.key, r.variant, r.match) for r in handle.rows})
            print("chosen: " + "; ".join(f"{key}: {name} ({match})" for key, name, match in chosen))
            results = benchmark(handle, causal_lm_steps(model, tokens), args.runs)
            rows += results
            print(render(results, handle))
            if dtype == "float32" and tokens == lengths[-1]:
                print(f"\nper call at decode size (1x1x{args.hidden}), us:")
                print(tabulate(overhead(model, handle, url),
                               headers=["path", "us/call", "vs kernel", "vs the floor"],
                               tablefmt="simple", disable_numparse=True))
            handle.undo()
    inside = sum(r.predicted_inside for r in rows)
    disturbed = sum(bool(r.problems()) for r in rows)
    share = 100 * inside / len(rows) if rows else 0.0
    print(f"\nall rows: predicted inside the measured 95% interval in {inside} of {len(rows)} "
          f"({share:.0f}%; target >= 90% on a quiet machine); {disturbed} row(s) marked disturbed")


if __name__ == "__main__":
    main()

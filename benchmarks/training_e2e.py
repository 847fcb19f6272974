"""What the winners are worth in training: a random transformers Llama made from its config is
captured, its norm shapes swept, patched for training (each op on its own) and trained patched
against an unpatched copy with identical weights, each with its own AdamW, on the same batches,
fp32 and bf16. Per op: the step gain predicted from the norms' forward+backward calls beside the
measured gain and its 95% interval, the peak memory of a step both ways, and every parameter
group's largest relative gradient difference after one step from identical weights.
Each key is swept in every pass of --passes; patch(mode="training") takes the forward+backward
winner where that pass was swept, else the forward's.

    python benchmarks/training_e2e.py [--hidden 1024] [--layers 4] [--tokens 128] [--runs 20]
                                      [--passes forward,forward+backward]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
from llama_args import add_llama_arguments, llama_config
from tabulate import tabulate

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.model.train_bench import TrainResult, benchmark_training, render_training
from fusionlab.shapes import format_shape


def summary_row(dtype: str, op: str, variants: str, result: TrainResult) -> list[str]:
    r = result.timing
    worst = max(result.gradients, key=lambda g: g.max_relative / g.tolerance)
    return [
        dtype, op, variants, f"{r.predicted_saving_ms:.2f} ms -> {r.predicted_gain:.4f}x",
        f"{r.gain:.4f}x [{r.low:.4f}, {r.high:.4f}]", "yes" if r.predicted_inside else "no",
        f"{r.unpatched_ms:.1f}", f"{r.patched_ms:.1f}",
        f"{result.unpatched.retained / 2**20:.1f} / {result.patched.retained / 2**20:.1f}",
        f"{result.unpatched.peak / 2**20:.1f} / {result.patched.peak / 2**20:.1f}",
        f"{worst.max_relative:.3g} ({worst.name}; tol {worst.tolerance:.3g})"
        + ("" if result.gradients_ok else " [differs]"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_arguments(parser, runs=20)
    parser.add_argument("--passes", default="forward,forward+backward",
                        help="the passes swept at each key (forward alone: the forward winners)")
    args = parser.parse_args()
    config = llama_config(args)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.tokens} tokens per sequence, "
          f"{args.runs} alternating training steps, {torch.get_num_threads()} thread(s)")
    storage = tempfile.mkdtemp(prefix="fusionlab-train-")
    summary = []
    for dtype in ("float32", "bfloat16"):
        model = tiny_model("llama-tiny", getattr(torch, dtype), overrides=config)
        found = capture(model, causal_lm_steps(model, args.tokens))
        url = f"sqlite:///{Path(storage) / f'{dtype}.db'}"
        for op in sorted({c.op for c in found.calls}):
            shapes = ",".join(sorted({format_shape(c.shape) for c in found.of_op(op)
                                      if c.step == "prefill"}))  # the training step's keys
            for pass_name in args.passes.split(","):
                sweep(op, shapes, dtype, storage=url, quick=True, variants=args.variants,
                      pass_name=pass_name)
            print(f"\n== {dtype}, {op}")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    handle = patch(model, found, storage=url, ops=[op], mode="training")
            except UserError as error:
                print(f"not patched: {error}")
                continue
            variants = ",".join(sorted({f"{r.variant} [{r.pass_name}]" for r in handle.rows
                                        if r.key.startswith(f"1x{args.tokens}x")}))
            print(f"chosen at 1x{args.tokens}x{args.hidden}: {variants}")
            results = benchmark_training(handle, [args.tokens], args.runs)
            print(render_training(results))
            summary += [summary_row(dtype, op, variants, result) for result in results]
            handle.undo()
    print("\nsummary (one training step: forward, next-token cross-entropy, backward, AdamW)")
    print(tabulate(summary, headers=[
        "dtype", "op", "variant", "predicted (saved -> gain)", "measured gain [95% CI]", "inside",
        "unpatched ms", "patched ms", "kept for backward MiB", "peak MiB",
        "largest gradient difference",
    ], tablefmt="github", disable_numparse=True))


if __name__ == "__main__":
    main()

"""Residual add + norm fusion in a model, against the alternatives, side by side in one run: a
random Llama made from its config (hidden 1024 x 4 layers by default), 128-token prefill and one
decode step, fp32 and bf16, 2 threads. Six configurations, timed in alternating rounds on the
same inputs (each round starts at another configuration):

    eager | eager patched | eager patched + fused | compile (inductor alone) |
    compile + patched | compile + fused pass (fusionlab.backend, then inductor)

Per configuration and step: median ms, the paired ratio eager / configuration with its 95%
bootstrap interval (fusionlab.model.bench.paired_ratio), logits max |diff| and argmax agreement
against eager unpatched, and, apart, the compile time (the first call of each compiled one).
The norms and fused ops are swept first (quick sweeps at the model's keys). The measuring is
fusionlab.model.fusion_bench, as `fusionlab bench-model --fuse` runs it.

    python benchmarks/model_fusion.py [--hidden 1024] [--layers 4] [--tokens 128] [--runs 15]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from llama_args import add_llama_arguments, llama_config

from fusionlab import capture, causal_lm_steps, sweep, tiny_model
from fusionlab.model.fusion_bench import Patching, measure_fusion
from fusionlab.model.fusion_table import render_fusion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_llama_arguments(parser, runs=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = llama_config(args)
    print(f"Llama hidden {args.hidden} x {args.layers} layers, {args.tokens}-token prefill and "
          f"one decode step, {args.runs} alternating rounds, {torch.get_num_threads()} thread(s)")
    folder = Path(tempfile.mkdtemp(prefix="fusionlab-fusion-"))
    shapes = f"1x{args.tokens}x{args.hidden},1x1x{args.hidden}"
    for dtype in args.dtypes.split(","):
        url = f"sqlite:///{folder / f'{dtype}.db'}"
        for op in ("rmsnorm", "add_rmsnorm"):
            sweep(op, shapes, dtype, storage=url, quick=True, variants=args.variants)
        model = tiny_model("llama-tiny", getattr(torch, dtype), overrides=config)
        found = capture(model, causal_lm_steps(model, args.tokens))
        result = measure_fusion(model, lambda copy: causal_lm_steps(copy, args.tokens),
                                Patching(found, url), args.runs, say=print)
        print(f"\n== {dtype}")
        print(render_fusion(result))


if __name__ == "__main__":
    main()

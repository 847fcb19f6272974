"""Residual add + norm fusion in a model, against the alternatives, side by side in one run: a
random Llama made from its config (hidden 1024 x 4 layers by default), 128-token prefill and one
decode step, fp32 and bf16, 2 threads. Six configurations, timed in alternating rounds on the
same inputs (each round starts at another configuration):

    eager | eager patched | eager patched + fused | compile (inductor alone) |
    compile + patched | compile + fused pass (fusionlab.backend, then inductor)

Per configuration and step: median ms, the paired ratio eager / configuration with its 95%
bootstrap interval (fusionlab.model.bench.paired_ratio), logits max |diff| and argmax agreement
against eager unpatched, and, apart, the compile time (the first call of each compiled one).
The norms and fused ops are swept first (quick sweeps at the model's keys).

    python benchmarks/model_fusion.py [--hidden 1024] [--layers 4] [--tokens 128] [--runs 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate

import fusionlab
from fusionlab import causal_lm_steps, patch, sweep, tiny_model
from fusionlab.model.bench import paired_ratio

CONFIGS = ("eager", "eager patched", "eager patched+fused", "compile (inductor)",
           "compile+patched", "compile+fused pass")


def _config(model: torch.nn.Module, url: str, tokens: int,
            name: str) -> dict[str, Callable[[], torch.Tensor]]:
    """One configuration's own copy of the model: its prefill and decode steps."""
    own = copy.deepcopy(model)
    if name in ("eager patched", "compile+patched"):
        patch(own, storage=url)
    elif name == "eager patched+fused":
        patch(own, storage=url, fuse=True)
    target: torch.nn.Module = own
    if name.startswith("compile"):
        backend = fusionlab.backend(storage=url) if name.endswith("pass") else "inductor"
        target = torch.compile(own, backend=backend)
    return {step.name: step.run for step in causal_lm_steps(target, tokens)}


def _ms(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return 1e3 * (time.perf_counter() - start)


def measure(model: torch.nn.Module, url: str, tokens: int, runs: int) -> list[list[str]]:
    """The table rows for one model (one dtype)."""
    rows = []
    with torch.no_grad():
        configs = {name: _config(model, url, tokens, name) for name in CONFIGS}
        # compile time apart: the first call of each step (causal_lm_steps ran one to fill the
        # cache: that first prefill is in neither figure)
        compile_ms = {name: {step: _ms(run) for step, run in configs[name].items()}
                      for name in CONFIGS}
        for step in ("prefill", "decode"):
            logits = {name: configs[name][step]().float() for name in CONFIGS}
            samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
            for name in CONFIGS:  # warm-up
                configs[name][step]()
            for round_index in range(runs):
                start = round_index % len(CONFIGS)
                for name in CONFIGS[start:] + CONFIGS[:start]:
                    samples[name].append(_ms(configs[name][step]))
            reference = logits["eager"]
            for name in CONFIGS:
                ratio, low, high = paired_ratio(samples["eager"], samples[name])
                agree = (logits[name].argmax(-1) == reference.argmax(-1)).float().mean().item()
                quartiles = statistics.quantiles(samples[name], n=4)
                rows.append([
                    step, name, f"{statistics.median(samples[name]):.3f}",
                    f"{quartiles[2] - quartiles[0]:.3f}", f"{ratio:.3f}x [{low:.3f}, {high:.3f}]",
                    f"{(logits[name] - reference).abs().max().item():.3g}", f"{100 * agree:.1f}%",
                    f"{compile_ms[name][step]:.0f}" if name.startswith("compile") else "-",
                ])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="builtin,naive,cpp")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # the compiled configurations compile one model's code three times each (cache fill,
    # prefill, decode): more entries than dynamo's default limit per code object
    torch._dynamo.config.recompile_limit = 64
    warnings.simplefilter("ignore")  # fallbacks are in the reports; the table says the rest
    config = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 8,
              "num_key_value_heads": 4}
    print(f"Llama hidden {args.hidden} x {args.layers} layers, {args.tokens}-token prefill and "
          f"one decode step, {args.runs} alternating rounds, {torch.get_num_threads()} thread(s)")
    folder = Path(tempfile.mkdtemp(prefix="fusionlab-fusion-"))
    shapes = f"1x{args.tokens}x{args.hidden},1x1x{args.hidden}"
    for dtype in ("float32", "bfloat16"):
        url = f"sqlite:///{folder / f'{dtype}.db'}"
        for op in ("rmsnorm", "add_rmsnorm"):
            sweep(op, shapes, dtype, storage=url, quick=True, variants=args.variants)
        model = tiny_model("llama-tiny", getattr(torch, dtype), overrides=config)
        fused = patch(copy.deepcopy(model), storage=url, fuse=True)
        with torch.no_grad():
            for step in causal_lm_steps(fused.model, args.tokens):
                step.run()
        print(f"\n== {dtype}: fused add + norm chosen per key")
        print("\n".join(f"  {r.path} {r.key}: {r.variant} [{r.match}] {r.numerics} {r.why}"
                        for r in fused.all_rows() if r.op == "add_rmsnorm"))
        torch._dynamo.reset()
        print(tabulate(measure(model, url, args.tokens, args.runs),
                       headers=["step", "configuration", "median ms", "IQR ms",
                                "eager / this [95% CI]", "max |dlogits|", "argmax agree",
                                "compile ms"],
                       tablefmt="simple", disable_numparse=True))
    print("\nratio > 1: faster than eager unpatched. compile ms: the first call (trace + "
          "inductor), apart from the timed rounds. Figures from one run on this machine; other "
          "processes running at the same time disturb them.")


if __name__ == "__main__":
    main()

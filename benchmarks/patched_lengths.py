"""A patched model at prompt lengths it was not captured at, side by side with the unpatched one.

Part 1 (float32 Llama): for each new length, the first eager call (where the patched model
resolves its keys) and the steady state, unpatched and patched, eager and under
torch.compile(dynamic=None) with inductor; compile time is reported apart (first compiled call
at the first two lengths). Bound checked: patched first eager call <= 2 x unpatched + 5 ms.
Part 2 (bfloat16 Gemma, 24 layers): argmax agreement and max |dlogits| of the patched prefill
against the unpatched one (goal: agreement >= 99.5%, here expected 100%: equal logits).

Run: python benchmarks/patched_lengths.py [--runs 15]  (a few minutes on a CPU)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate

from fusionlab import capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.shapes import format_shape

CAPTURED = 32
LENGTHS = (17, 45, 77, 100, 129)
LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
GEMMA_24 = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 24}


def _ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(tokens))


def _ms(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return 1e3 * (time.perf_counter() - start)


def _steady(call: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median and interquartile range (ms) after two warm-up calls."""
    call()
    call()
    samples = sorted(_ms(call) for _ in range(runs))
    quartiles = statistics.quantiles(samples, n=4)
    return statistics.median(samples), quartiles[2] - quartiles[0]


def _swept(model: torch.nn.Module, folder: Path, dtype: str, variants: str) -> tuple[object, str]:
    found = capture(model, causal_lm_steps(model, CAPTURED), repeats=3)
    url = f"sqlite:///{folder / f'{dtype}.db'}"
    shapes = ",".join(sorted({format_shape(c.shape) for c in found.calls}))
    sweep("rmsnorm", shapes, dtype, storage=url, quick=True, variants=variants)
    return found, url


def lengths_table(folder: Path, runs: int) -> str:
    model = tiny_model("llama-tiny", overrides=LLAMA)
    found, url = _swept(model, folder, "float32", "builtin,naive")

    def prefill(target: torch.nn.Module, tokens: int) -> Callable[[], object]:
        ids = _ids(tokens)
        return lambda: target(ids, use_cache=False)

    rows = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = patch(model, found, storage=url)
        handle.undo()
        torch._dynamo.reset()
        compiled_unpatched = torch.compile(model, dynamic=None)
        unpatched = {n: (_ms(prefill(model, n)), _steady(prefill(model, n), runs),
                         _ms(prefill(compiled_unpatched, n)),
                         _steady(prefill(compiled_unpatched, n), runs)) for n in LENGTHS}
        handle.redo()
        torch._dynamo.reset()
        compiled_patched = torch.compile(model, dynamic=None)
        for n in LENGTHS:
            first = _ms(prefill(model, n))  # resolves this length's keys
            steady = _steady(prefill(model, n), runs)
            compiled_first = _ms(prefill(compiled_patched, n))
            compiled = _steady(prefill(compiled_patched, n), runs)
            u_first, u_steady, u_compiled_first, u_compiled = unpatched[n]
            bound = 2 * u_first + 5
            rows.append([
                n, f"{u_first:.2f}", f"{first:.2f}", f"{bound:.2f}",
                "yes" if first <= bound else "NO",
                f"{u_steady[0]:.2f} ±{u_steady[1]:.2f}", f"{steady[0]:.2f} ±{steady[1]:.2f}",
                f"{u_compiled_first:.1f}", f"{compiled_first:.1f}",
                f"{u_compiled[0]:.2f} ±{u_compiled[1]:.2f}",
                f"{compiled[0]:.2f} ±{compiled[1]:.2f}",
                f"{compiled[0] / u_compiled[0]:.2f}x",
            ])
        handle.undo()
        torch._dynamo.reset()
    header = ["tokens", "eager 1st unp.", "eager 1st patched", "bound", "within",
              "eager unp. (med ±IQR)", "eager patched", "compiled 1st unp.",
              "compiled 1st patched", "compiled unp.", "compiled patched", "compiled p/u"]
    return (tabulate(rows, headers=header, tablefmt="simple", disable_numparse=True)
            + f"\nms; Llama {LLAMA}, captured at {CAPTURED} tokens, fp32, "
            f"{torch.get_num_threads()} thread(s); 'compiled 1st' includes compile time "
            "(a retrace shows as seconds)")


def agreement_line(folder: Path) -> str:
    model = tiny_model("gemma-tiny", torch.bfloat16, overrides=GEMMA_24)
    found, url = _swept(model, folder, "bfloat16", "builtin,naive,cpp")
    ids = _ids(CAPTURED)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = model(ids, use_cache=False).logits.float()
        handle = patch(model, found, storage=url)
        patched = model(ids, use_cache=False).logits.float()
        longer = _ids(LENGTHS[-1])
        handle.undo()
        reference_long = model(longer, use_cache=False).logits.float()
        handle.redo()
        patched_long = model(longer, use_cache=False).logits.float()
        handle.undo()
    chosen = sorted({row.variant for row in handle.rows})
    lines = [f"bf16 Gemma, 24 layers, hidden {GEMMA_24['hidden_size']}: variants used {chosen}"]
    for tokens, want, got in ((CAPTURED, reference, patched),
                              (LENGTHS[-1], reference_long, patched_long)):
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        lines.append(f"  prefill {tokens} tokens: argmax agreement {100 * agree:.2f}%, "
                     f"max |dlogits| {(got - want).abs().max().item():.3g}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="timed calls per steady state")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(lengths_table(Path(folder), args.runs))
        print()
        print(agreement_line(Path(folder)))


if __name__ == "__main__":
    main()

"""What the winners are worth inside a model: a random transformers Llama made from its config is
captured, its norm shapes swept, patched, and timed patched and unpatched alternately at prefill and
decode, fp32 and bf16; predicted (from the sweep) and measured end-to-end gains side by side. Then
the patched path's own cost per call at decode size: the patched module against the chosen kernel
called directly (target: within 1 us), the Dispatcher, and the model's own module.

    python benchmarks/model_e2e.py [--hidden 1024] [--layers 4] [--tokens 128] [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import timeit
import warnings
from pathlib import Path

import torch
from tabulate import tabulate

from fusionlab import Dispatcher, capture, causal_lm_steps, patch, sweep, tiny_model
from fusionlab.errors import UserError
from fusionlab.model.bench import benchmark, render
from fusionlab.shapes import format_shape


def per_call_us(call: object, loops: int = 2000, repeats: int = 15) -> float:
    """Median over repeats of the mean time of one call (the CPU runs synchronously)."""
    times = timeit.repeat(call, number=loops, repeat=repeats)  # type: ignore[arg-type]
    return 1e6 * statistics.median(times) / loops


def overhead(model: torch.nn.Module, handle: object, url: str) -> list[list[str]]:
    """The patched module vs its chosen kernel called directly, at decode size."""
    norm = model.model.norm
    hidden = norm.weight.shape[0]
    x = torch.randn(1, 1, hidden, dtype=norm.weight.dtype)
    weight, eps = norm.weight, norm.variance_epsilon
    call = next(c for (shape, _), c in handle.modules[-1].table.items() if shape[-2] == 1)
    dispatcher = Dispatcher("rmsnorm", url)
    dispatcher(x, weight, eps)
    kernel = dispatcher._resolve((x, weight, eps))
    with torch.no_grad():
        direct = per_call_us(lambda: kernel(x, weight, eps))
        bound = per_call_us(lambda: call(x))
        patched = per_call_us(lambda: norm(x))
        dispatched = per_call_us(lambda: dispatcher(x, weight, eps))
        handle.undo()
        own = per_call_us(lambda: norm(x))
        handle.redo()
        identity = torch.nn.Identity()
        bare = per_call_us(lambda: identity(x))
    return [
        ["chosen kernel called directly", f"{direct:.2f}", "-"],
        ["patched table lookup + kernel", f"{bound:.2f}", f"{bound - direct:+.2f}"],
        ["patched module: model.norm(x)", f"{patched:.2f}", f"{patched - direct:+.2f}"],
        ["  of which any module call costs (nn.Identity)", f"{bare:.2f}", "-"],
        ["fusionlab.Dispatcher(x, w, eps)", f"{dispatched:.2f}", f"{dispatched - direct:+.2f}"],
        ["the model's own module, unpatched", f"{own:.2f}", f"{own - direct:+.2f}"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--variants", default="builtin,naive,cpp")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    config = {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
              "num_hidden_layers": args.layers, "num_attention_heads": 8,
              "num_key_value_heads": 4}
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.tokens}-token prefill and one "
          f"decode step, {torch.get_num_threads()} thread(s); machine shared with other jobs")
    storage = tempfile.mkdtemp(prefix="fusionlab-e2e-")
    for dtype in ("float32", "bfloat16"):
        model = tiny_model("llama-tiny", getattr(torch, dtype), overrides=config)
        steps = causal_lm_steps(model, args.tokens)
        found = capture(model, steps)
        url = f"sqlite:///{Path(storage) / f'{dtype}.db'}"
        shapes = ",".join(sorted({format_shape(c.shape) for c in found.of_op("rmsnorm")}))
        sweep("rmsnorm", shapes, dtype, storage=url, quick=True, variants=args.variants)
        print(f"\n== {dtype}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                handle = patch(model, found, storage=url)
        except UserError as error:
            print(f"not patched: {error}")
            continue
        chosen = sorted({(r.key, r.variant, r.match) for r in handle.rows})
        print("chosen: " + "; ".join(f"{key}: {name} ({match})" for key, name, match in chosen))
        print(render(benchmark(handle, steps, args.runs), handle))
        if dtype == "float32":
            print(f"\nper call at decode size (1x1x{args.hidden}), us:")
            print(tabulate(overhead(model, handle, url), headers=["path", "us/call", "vs kernel"],
                           tablefmt="simple", disable_numparse=True))
        handle.undo()


if __name__ == "__main__":
    main()

"""The fused C++ backward of the cpp rmsnorm and layernorm, recomputing the row statistics
(`backward=fused`) against reading those the forward saved (`backward=fused-saved`), timed side by
side in interleaved rounds.

Each backward is `torch.autograd.grad` from a kept forward (retain_graph), as the sweep's backward
pass times it. Every round times `--calls` backwards of each, the order swapped each round; a
round's ratio is fused's median / fused-saved's median, so above 1 means saving the statistics is
faster. Printed per op, shape and dtype: both medians over all calls, the median ratio and its
spread over the rounds (interquartile range, then min and max). Also the bytes each keeps for
backward beyond the same forward: fused-saved adds 4 bytes a row (rmsnorm) or 8 (layernorm).

    python benchmarks/saved_stats.py [--shapes 32x4096,512x4096,2048x4096] [--rounds 15]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from tabulate import tabulate

from fusionlab.registry import get_variant
from fusionlab.shapes import parse_shapes

BACKWARDS = ("fused", "fused-saved")
OPS = {"rmsnorm": 2, "layernorm": 3}  # op: how many of (x, weight, bias) it takes
EPS = 1e-5


def _backward(op: str, backward: str, shape: tuple[int, ...],
              dtype: torch.dtype) -> Callable[[], object]:
    """One kept forward of the cpp variant with `backward`; returns a call of its backward."""
    kernel = get_variant(op, "cpp").factory("cpu", rows_per_task=16, backward=backward)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g), 1 + 0.5 * torch.randn(shape[-1], generator=g),
               0.5 * torch.randn(shape[-1], generator=g)][:OPS[op]]
    leaves = [t.to(dtype).requires_grad_() for t in tensors]
    y = kernel(*leaves, EPS)
    upstream = torch.randn(shape, generator=g).to(dtype)
    return lambda: torch.autograd.grad(y, leaves, upstream, retain_graph=True)


def _times_ms(call: Callable[[], object], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - start) * 1e-6)
    return times


def measure(op: str, shape: tuple[int, ...], dtype: torch.dtype, rounds: int,
            calls: int) -> list[str]:
    runs = {backward: _backward(op, backward, shape, dtype) for backward in BACKWARDS}
    for run in runs.values():
        _times_ms(run, 3)  # warm: first-touch of the outputs, the allocator's free lists
    all_ms: dict[str, list[float]] = {backward: [] for backward in BACKWARDS}
    ratios = []
    for number in range(rounds):
        order = BACKWARDS if number % 2 == 0 else BACKWARDS[::-1]
        medians = {}
        for backward in order:
            times = _times_ms(runs[backward], calls)
            all_ms[backward] += times
            medians[backward] = statistics.median(times)
        ratios.append(medians["fused"] / medians["fused-saved"])
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    stat_bytes = 4 * (OPS[op] - 1) * math.prod(shape[:-1])  # rstd; and mean for layernorm
    return [op, "x".join(map(str, shape)), str(dtype).removeprefix("torch."),
            f"{statistics.median(all_ms['fused']):.4g}",
            f"{statistics.median(all_ms['fused-saved']):.4g}",
            f"{statistics.median(ratios):.3f}x", f"[{q1:.3f}, {q3:.3f}]",
            f"[{min(ratios):.3f}, {max(ratios):.3f}]", f"{stat_bytes}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32x4096,512x4096,2048x4096")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=9, help="backwards of each per round")
    args = parser.parse_args()
    table = [measure(op, shape, dtype, args.rounds, args.calls)
             for op in OPS for shape in parse_shapes(args.shapes)
             for dtype in (torch.float32, torch.bfloat16)]
    print(f"fused vs fused-saved backward, {torch.get_num_threads()} thread(s), {args.rounds} "
          f"interleaved rounds of {args.calls} calls each")
    print(tabulate(table, headers=["op", "shape", "dtype", "fused ms", "fused-saved ms",
                                   "fused / saved", "IQR", "min, max", "stats bytes"]))


if __name__ == "__main__":
    main()

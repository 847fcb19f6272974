"""Evidence for limits.SLACK: how close honest RMSNorm lowerings get to this device's copy limit.

For each shape, dtype, thread count and cache state (warm: one input reused; cold: inputs rotated
past the last-level cache), in one interleaved measurement: clone, copy_, the naive chain,
torch.rms_norm, torch.compile of the naive chain, the C++ kernel at every rows_per_task, and a
cheat that returns a cached result. Each lowering's achieved GB/s (read x and weight, write y)
over max(clone, copy_) GB/s at the same state is its ratio; the largest honest ratio must stay
below SLACK with a margin, the cheat must land far above it. Medians of `--rounds` rounds.

    python benchmarks/limits_slack.py [--shapes 1x4096,...] [--dtypes float32,bfloat16]
        [--threads 1,2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
from tabulate import tabulate

from fusionlab.devices.cpu import cpu_llc_bytes
from fusionlab.kernels.compiling import compiled_copy
from fusionlab.kernels.rmsnorm.cpu_cpp import ROWS_PER_TASK_CHOICES, rms_norm_cpp
from fusionlab.kernels.rmsnorm.framework import builtin_rmsnorm, naive_rmsnorm
from fusionlab.measure.limits import SLACK, _Rotating, _rotation, median_call_s

SHAPES = "1x4096,32x4096,512x4096,2048x8192,2048x4096"
EPS = 1e-6
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}
SAMPLES = 7
COPIES = ("clone", "copy_")
CHEAT = "cached"


def _kernels(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Callable[..., object]]:
    """Every honest lowering, each checked once against a float64 reference."""
    kernels: dict[str, Callable[..., object]] = {
        "naive": naive_rmsnorm,
        "builtin": builtin_rmsnorm,
        "compiled": compiled_copy(naive_rmsnorm, "cpu", mode="default", dynamic=False),
    }
    for rows in ROWS_PER_TASK_CHOICES:
        kernels[f"cpp/{rows}"] = lambda x, w, eps, rows=rows: rms_norm_cpp(x, w, eps, rows)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=generator)).to(dtype)
    h = x.double()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    tol = TOLERANCE[dtype]
    for name, kernel in kernels.items():
        err = (kernel(x, w, EPS).double() - ref).abs()
        if not bool((err <= tol + tol * ref.abs()).all()):
            raise AssertionError(f"{name} is wrong at {shape} {dtype}: max err {err.max():.3g}")
    return kernels


def _measure(
    shape: tuple[int, ...], dtype: torch.dtype, kernels: dict[str, Callable[..., object]],
    cold: bool, rounds: int,
) -> dict[str, float]:
    """Median seconds per call of the copies, the lowerings and the cheat, interleaved."""
    numel = math.prod(shape)
    count, _, _ = _rotation(numel * dtype.itemsize, cpu_llc_bytes(), cold)
    xs = [torch.randn(shape).to(dtype) for _ in range(count)]
    w = (1 + 0.5 * torch.randn(shape[-1])).to(dtype)
    targets = [torch.empty_like(x) for x in xs]
    cached = kernels["builtin"](xs[0], w, EPS)
    calls: dict[str, Callable[[], object]] = {
        "clone": _Rotating(torch.Tensor.clone, [(x,) for x in xs]),
        "copy_": _Rotating(torch.Tensor.copy_, list(zip(targets, xs, strict=True))),
        CHEAT: lambda: cached,
    }
    for name, kernel in kernels.items():
        calls[name] = _Rotating(kernel, [(x, w, EPS) for x in xs])
    taken = [median_call_s(calls, lambda: None, SAMPLES) for _ in range(rounds)]
    return {name: statistics.median(t[name] for t in taken) for name in calls}


class _Tally:
    """What the runs found: the table's rows, the largest honest ratio per (state, threads), each
    cheat's ratio, and each warm result judged against a cold limit."""

    def __init__(self) -> None:
        self.rows: list[list[object]] = []
        self.worst: dict[tuple[str, int], tuple[float, str]] = {}
        self.cheats: list[float] = []
        self.cross: list[float] = []

    def cell(self, shape: tuple[int, ...], dtype: torch.dtype, threads: list[int],
             rounds: int) -> list[str]:
        """Measure one shape and dtype at each thread count, warm and cold; the kernels' names."""
        kernels = _kernels(shape, dtype)
        numel = math.prod(shape)
        label = f"{'x'.join(map(str, shape))} {str(dtype)[6:]}"
        moved = (2 * numel + shape[-1]) * dtype.itemsize
        copied = 2 * numel * dtype.itemsize
        limits = {}
        for n in threads:
            torch.set_num_threads(n)
            for cold in (False, True):
                times = _measure(shape, dtype, kernels, cold, rounds)
                limit = max(copied / times[c] for c in COPIES) / 1e9
                limits[(n, cold)] = (limit, times)
                ratio = {k: moved / times[k] / 1e9 / limit for k in kernels}
                best = max(ratio, key=ratio.__getitem__)
                state = "cold" if cold else "warm"
                if ratio[best] > self.worst.get((state, n), (0.0, ""))[0]:
                    self.worst[(state, n)] = (ratio[best], f"{best} {label}")
                self.cheats.append(moved / times[CHEAT] / 1e9 / limit)
                self.rows.append([
                    "x".join(map(str, shape)), str(dtype)[6:], n, state,
                    *(f"{copied / times[c] / 1e9:.3g}" for c in COPIES),
                    *(f"{ratio[k]:.2f}" for k in kernels), f"{self.cheats[-1]:.0f}",
                ])
        for n in threads:  # a warm result judged against a cold limit: why states must match
            _, warm_times = limits[(n, False)]
            cold_limit, _ = limits[(n, True)]
            self.cross.append(max(moved / warm_times[k] / 1e9 / cold_limit for k in kernels))
        return list(kernels)

    def report(self, kernels: list[str]) -> None:
        headers = ["shape", "dtype", "thr", "state", "clone GB/s", "copy_ GB/s",
                   *(f"{k}/lim" for k in kernels), f"{CHEAT}/lim"]
        print(tabulate(self.rows, headers=headers, tablefmt="simple", disable_numparse=True))
        print("\nlargest honest ratio achieved / max(clone, copy_), like for like:")
        for (state, n), (value, where) in sorted(self.worst.items()):
            print(f"  {state} threads={n}: {value:.2f} ({where})")
        top = max(value for value, _ in self.worst.values())
        print(f"overall {top:.2f}: SLACK {SLACK} leaves a {SLACK / top:.2f}x margin")
        print(f"cheat ratio: min {min(self.cheats):.0f}, max {max(self.cheats):.0f} (all flagged: "
              f"{'yes' if min(self.cheats) > SLACK else 'NO'})")
        print(f"warm result vs cold limit (mismatched states), largest honest ratio: "
              f"{max(self.cross):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"torch {torch.__version__}, LLC {cpu_llc_bytes()} B, threads {threads}, SLACK {SLACK}")
    tally = _Tally()
    kernels: list[str] = []
    for dtype in dtypes:
        for shape in shapes:
            kernels = tally.cell(shape, dtype, threads, args.rounds)
    tally.report(kernels)


if __name__ == "__main__":
    main()

"""Does the harness measure what torch.utils.benchmark measures?

Prints, from one run: for each variant and shape, the harness's median next to
torch.utils.benchmark.Timer's median on the same callable and the same one input set (target
ratio 0.9-1.1). The harness's own cost per trial is benchmarks/harness_overhead.py.

    python benchmarks/harness_vs_timer.py [--shapes 32x4096,512x4096] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.utils.benchmark as torch_benchmark
from tabulate import tabulate

from fusionlab.devices import get_device
from fusionlab.measure.timing import TimingSettings, time_calls, timed_once
from fusionlab.registry import get_op, variants_of
from fusionlab.shapes import parse_dtype, parse_shapes, torch_dtype

CONFIGS = [("naive", {}), ("builtin", {}), ("compiled", {"mode": "default", "dynamic": False}),
           ("cpp", {"rows_per_task": 16})]


def compare_timers(shapes: list[tuple[int, ...]], dtype: str, rounds: int) -> list[list[str]]:
    spec = get_op("rmsnorm")
    device = get_device("cpu")
    rows = []
    for shape in shapes:
        inputs = spec.make_inputs(shape, torch_dtype(dtype), device.torch_device, 0)
        for name, params in CONFIGS:
            variant = variants_of("rmsnorm")[name]
            if variant.unavailable_reason("cpu"):
                continue
            kernel = variant.factory("cpu", **params)
            timed_once(lambda kernel=kernel, inputs=inputs: kernel(*inputs), device.synchronize)
            ours, theirs = [], []
            for _ in range(rounds):  # alternate the two timers so drift hits both alike
                loop = time_calls(lambda index, kernel=kernel, inputs=inputs: kernel(*inputs), 1,
                                  device.synchronize, TimingSettings(budget_s=0.4, checked_calls=0))
                ours.append(loop.timing.median_ms)
                timer = torch_benchmark.Timer("kernel(*inputs)",
                                              globals={"kernel": kernel, "inputs": inputs},
                                              num_threads=torch.get_num_threads())
                theirs.append(timer.blocked_autorange(min_run_time=0.4).median * 1e3)
            mine, reference = statistics.median(ours), statistics.median(theirs)
            rows.append(["x".join(map(str, shape)), name, f"{mine:.4g}", f"{reference:.4g}",
                         f"{mine / reference:.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="32x4096,512x4096")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shapes, dtype = parse_shapes(args.shapes), parse_dtype(args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}")
    rows = compare_timers(shapes, dtype, args.rounds)
    print(tabulate(rows, headers=["shape", "variant", "harness ms", "Timer ms", "ratio"],
                   tablefmt="simple", disable_numparse=True))
    ratios = [float(row[-1]) for row in rows]
    print(f"ratio range {min(ratios):.3f}-{max(ratios):.3f} (target 0.9-1.1)")


if __name__ == "__main__":
    main()

"""Does the harness measure what torch.utils.benchmark measures, and what does a sweep cost?

Prints, from one run: for each variant and shape, the harness's median next to
torch.utils.benchmark.Timer's median on the same callable and inputs (target ratio 0.9-1.1), then a
small sweep's wall time against the time spent inside timed samples (the harness overhead).

    python benchmarks/harness_vs_timer.py [--shapes 32x4096,512x4096] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.benchmark as torch_benchmark
from tabulate import tabulate

from fusionlab import sweep
from fusionlab.devices import Device
from fusionlab.measure.timing import TimingSettings, time_calls, timed_once
from fusionlab.registry import get_op, variants_of
from fusionlab.shapes import parse_dtype, parse_shapes, torch_dtype

CONFIGS = [("naive", {}), ("builtin", {}), ("compiled", {"mode": "default", "dynamic": False}),
           ("cpp", {"rows_per_task": 16})]


def compare_timers(shapes: list[tuple[int, ...]], dtype: str, rounds: int) -> list[list[str]]:
    spec = get_op("rmsnorm")
    device = Device("cpu")
    rows = []
    for shape in shapes:
        inputs = spec.make_inputs(shape, torch_dtype(dtype), device.torch_device, 0)
        for name, params in CONFIGS:
            variant = variants_of("rmsnorm")[name]
            if variant.unavailable_reason("cpu"):
                continue
            kernel = variant.factory("cpu", **params)
            _, first_ms = timed_once(lambda kernel=kernel, inputs=inputs: kernel(*inputs),
                                    device.synchronize)
            ours, theirs = [], []
            for _ in range(rounds):  # alternate the two timers so drift hits both alike
                timing = time_calls(lambda kernel=kernel, inputs=inputs: kernel(*inputs),
                                    device.synchronize,
                                    first_ms, TimingSettings())
                ours.append(timing.median_ms)
                timer = torch_benchmark.Timer("kernel(*inputs)",
                                              globals={"kernel": kernel, "inputs": inputs},
                                              num_threads=torch.get_num_threads())
                theirs.append(timer.blocked_autorange(min_run_time=0.4).median * 1e3)
            mine, reference = statistics.median(ours), statistics.median(theirs)
            rows.append(["x".join(map(str, shape)), name, f"{mine:.4g}", f"{reference:.4g}",
                         f"{mine / reference:.3f}"])
    return rows


def sweep_overhead(shapes: str, dtype: str) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'overhead.db'}"
        start = time.perf_counter()
        cells = sweep("rmsnorm", shapes, dtype, device="cpu", storage=url,
                      variants=["naive", "builtin"])
        wall = time.perf_counter() - start
    records = [r for cell in cells for r in cell.records if r.timing]
    measured = sum(sum(r.timing.samples_ms) * r.timing.calls_per_sample / 1e3 for r in records)
    return wall, measured, len(records)


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
    wall, measured, trials = sweep_overhead(args.shapes, dtype)
    print(f"sweep of naive,builtin at {args.shapes}: wall {wall:.2f} s for {trials} trials, "
          f"{measured:.2f} s of it inside timed samples (wall / timed = {wall / measured:.1f}); "
          f"{(wall - measured) / trials:.2f} s of harness work per trial, worker start included")


if __name__ == "__main__":
    main()

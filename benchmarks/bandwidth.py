"""Effective bandwidth of every RMSNorm lowering against this device's own copy bandwidth.

For each shape and dtype, in one run: the bandwidth of a fresh-output copy of the input
(`x.clone()`, allocation included: the limit for an out-of-place op) and of an in-place copy
(`y.copy_(x)`, for reference), then every available variant at its best tunables (bytes the op must
move / median latency) as a share of the clone bandwidth, and the targets as ratios:
  * the best lowering reaches >= 85% of clone bandwidth for tensors of 16 MB and more (CPU);
  * the C++ kernel is within 5% of the fastest other variant at every shape, and faster than
    torch.rms_norm at every shape of 1 MB or more (CPU);
  * the Triton kernel reaches >= 80% of copy bandwidth at 64 MB and more and is within 10% of
    torch.compile at every shape (CUDA).
Contenders are interleaved over several rounds and the median of the rounds is kept.

    python benchmarks/bandwidth.py [--device cpu] [--shapes ...] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
from tabulate import tabulate

from fusionlab.api import DEFAULT_SHAPES
from fusionlab.devices import Device, resolve_device
from fusionlab.measure.correctness import check_output
from fusionlab.measure.timing import TimingSettings, time_calls, timed_once
from fusionlab.registry import get_op, variants_of
from fusionlab.shapes import format_shape, parse_dtypes, parse_shapes, torch_dtype

SHAPES = DEFAULT_SHAPES + ",2048x4096,4x2048x4096"
SETTINGS = TimingSettings(budget_s=0.3, min_samples=10)


def _median_ms(call: Callable[[], object], device: Device) -> float:
    _, first = timed_once(call, device.synchronize)
    return time_calls(call, device.synchronize, first, SETTINGS).median_ms


def _contenders(shape, dtype, device: Device, inputs) -> dict[str, Callable[[], object]]:
    """Every correct configuration of every variant that runs here, plus the two copies."""
    spec = get_op("rmsnorm")
    x = inputs[0]
    target = torch.empty_like(x)
    calls: dict[str, Callable[[], object]] = {
        "clone": lambda: x.clone(),
        "copy_": lambda: target.copy_(x),
    }
    reference = spec.reference(inputs)
    for variant in variants_of("rmsnorm").values():
        if variant.unavailable_reason(device.type) or dtype not in variant.dtypes:
            continue
        for params in variant.configurations():
            if variant.rejects(shape, params, device.type):
                continue
            kernel = variant.factory(device.type, **params)
            check_output(kernel(*inputs), reference, x, spec.tolerance(x.dtype))
            label = variant.name + "".join(f" {k}={v}" for k, v in params.items())
            calls[label] = lambda kernel=kernel: kernel(*inputs)
    return calls


def measure(shape, dtype: str, device: Device, rounds: int) -> dict[str, float]:
    spec = get_op("rmsnorm")
    inputs = spec.make_inputs(shape, torch_dtype(dtype), device.torch_device, 0)
    calls = _contenders(shape, dtype, device, inputs)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(_median_ms(call, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def _best(times: dict[str, float], variant: str) -> float | None:
    mine = [t for name, t in times.items() if name.split()[0] == variant]
    return min(mine) if mine else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    spec = get_op("rmsnorm")
    print(f"{device.hardware_name()}, torch {torch.__version__}")
    rows, checks = [], []
    for dtype in parse_dtypes(args.dtypes):
        for shape in parse_shapes(args.shapes):
            times = measure(shape, dtype, device, args.rounds)
            tensor_bytes = 2 * math.prod(shape) * torch_dtype(dtype).itemsize  # read + write
            mb = tensor_bytes / 2 / 1e6
            clone_gbps = tensor_bytes / (times["clone"] * 1e-3) / 1e9
            copy_gbps = tensor_bytes / (times["copy_"] * 1e-3) / 1e9
            variants = sorted({name.split()[0] for name in times} - {"clone", "copy_"})
            best = {v: _best(times, v) for v in variants}
            moved = spec.bytes_moved(shape, torch_dtype(dtype))
            share = {v: moved / (t * 1e-3) / 1e9 / clone_gbps for v, t in best.items() if t}
            winner = min(best, key=lambda v: best[v] or float("inf"))
            rows.append([format_shape(shape), dtype, f"{mb:.2f}", f"{clone_gbps:.1f}",
                         f"{copy_gbps:.1f}", winner,
                         *(f"{100 * share[v]:.0f}%" if v in share else "-" for v in variants)])
            checks += _targets(format_shape(shape), dtype, mb, best, share, clone_gbps, copy_gbps,
                               device, moved)
    headers = ["shape", "dtype", "MB", "clone GB/s", "copy_ GB/s", "fastest",
               *(f"{v} % of clone" for v in variants)]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    print("\ntargets (ratio; met?)")
    for line in checks:
        print("  " + line)


def _targets(shape, dtype, mb, best, share, clone_gbps, copy_gbps, device, moved) -> list[str]:
    lines = []
    if device.type == "cpu":
        if mb >= 16:
            top = max(share.values())
            lines.append(f"{shape} {dtype}: best lowering {100 * top:.0f}% of clone "
                         f"(>= 85%: {'yes' if top >= 0.85 else 'NO'})")
        if best.get("cpp"):
            others = [t for v, t in best.items() if v != "cpp" and t]
            ratio = best["cpp"] / min(others)
            lines.append(f"{shape} {dtype}: cpp / fastest other = {ratio:.2f} "
                         f"(<= 1.05: {'yes' if ratio <= 1.05 else 'NO'})")
            if mb >= 1 and best.get("builtin"):
                ratio = best["cpp"] / best["builtin"]
                lines.append(f"{shape} {dtype}: cpp / builtin = {ratio:.2f} "
                             f"(< 1: {'yes' if ratio < 1 else 'NO'})")
    if device.type == "cuda" and best.get("triton"):
        if mb >= 64:
            gbps = moved / (best["triton"] * 1e-3) / 1e9
            lines.append(f"{shape} {dtype}: triton {100 * gbps / copy_gbps:.0f}% of copy_ "
                         f"(>= 80%: {'yes' if gbps >= 0.8 * copy_gbps else 'NO'})")
        if best.get("compiled"):
            ratio = best["triton"] / best["compiled"]
            lines.append(f"{shape} {dtype}: triton / compiled = {ratio:.2f} "
                         f"(<= 1.10: {'yes' if ratio <= 1.10 else 'NO'})")
    return lines


if __name__ == "__main__":
    main()

"""Effective bandwidth of every lowering of each op against this device's own copy bandwidth.

For each op, shape and dtype, in one run: the bandwidth of a fresh-output copy of x (`x.clone()`,
allocation included: the limit for an out-of-place op) and of an in-place copy (`y.copy_(x)`, for
reference), then every available variant at its best tunables (the op's bytes_moved / median
latency) as a share of the clone bandwidth (of copy_ for in-place variants, which allocate
nothing), and the targets as ratios, misses marked NO:
  * the best out-of-place lowering reaches >= 85% of clone bandwidth where x is >= 16 MB (CPU);
  * each C++ kernel is within 5% of the fastest non-C++ variant at every default shape (CPU);
  * the Triton kernel reaches >= 80% of copy bandwidth at 64 MB and more and is within 10% of
    torch.compile at every shape (CUDA).
Every correct configuration is measured; contenders are interleaved over several rounds and the
median of the rounds is kept. In-place variants run on private copies of the inputs.

    python benchmarks/bandwidth.py [--ops rmsnorm,layernorm,add_rmsnorm] [--device cpu]
                                   [--shapes ...] [--dtypes float32,bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
from tabulate import tabulate

from fusionlab.devices import Device, resolve_device
from fusionlab.measure.correctness import check_values
from fusionlab.measure.timing import TimingSettings, time_calls
from fusionlab.op import Inputs, OpSpec, Shape
from fusionlab.registry import get_op, op_names, variants_of
from fusionlab.shapes import format_shape, parse_dtypes, parse_list, parse_shapes, torch_dtype

EXTRA_SHAPES = "2048x4096,4x2048x4096"
SETTINGS = TimingSettings(budget_s=0.2, min_samples=10, checked_calls=0)
COPIES = ("clone", "copy_")


def _median_ms(call: Callable[[], object], device: Device) -> float:
    return time_calls(lambda index: call(), 1, device.synchronize, SETTINGS).timing.median_ms


def _private(inputs: Inputs) -> Inputs:
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)


def _contenders(spec: OpSpec, dtype: str, device: Device, inputs: Inputs) -> dict[str, Callable]:
    """Every correct configuration of every variant that runs here, plus the two copies."""
    x = inputs[0]
    assert isinstance(x, torch.Tensor)
    shape = tuple(x.shape)
    target = torch.empty_like(x)
    calls: dict[str, Callable[[], object]] = {
        "clone": lambda: x.clone(),
        "copy_": lambda: target.copy_(x),
    }
    reference = spec.reference(inputs)
    for variant in variants_of(spec.name).values():
        if variant.unavailable_reason(device.type) or dtype not in variant.dtypes:
            continue
        for params in variant.configurations():
            if variant.rejects(shape, params, device.type):
                continue
            kernel = variant.factory(device.type, **params)
            own = _private(inputs) if variant.inplace else inputs
            check_values(spec.as_outputs(kernel(*_private(own))), reference, spec, x,
                         spec.tolerance(x.dtype))
            label = variant.name + "".join(f" {k}={v}" for k, v in params.items())
            calls[label] = lambda kernel=kernel, own=own: kernel(*own)
    return calls


def measure(spec: OpSpec, shape: Shape, dtype: str, device: Device, rounds: int) -> dict:
    """Median over interleaved rounds of each contender's median latency in ms."""
    inputs = spec.make_inputs(shape, torch_dtype(dtype), device.torch_device, 0)
    calls = _contenders(spec, dtype, device, inputs)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(_median_ms(call, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def _best(times: dict[str, float], variant: str) -> float | None:
    mine = [t for name, t in times.items() if name.split()[0] == variant]
    return min(mine) if mine else None


def _is_cpp(variant: str) -> bool:
    return variant == "cpp" or variant.startswith("cpp-")


def run_op(op: str, args: argparse.Namespace, device: Device) -> None:
    spec = get_op(op)
    shapes = args.shapes or f"{spec.default_shapes},{EXTRA_SHAPES}"
    default = set(parse_shapes(spec.default_shapes))
    registered = variants_of(op)
    rows, checks, variants = [], [], []
    for dtype in parse_dtypes(args.dtypes):
        for shape in dict.fromkeys(parse_shapes(shapes)):
            times = measure(spec, shape, dtype, device, args.rounds)
            x_bytes = math.prod(shape) * torch_dtype(dtype).itemsize
            mb = x_bytes / 1e6
            clone_gbps, copy_gbps = (2 * x_bytes / (times[c] * 1e-3) / 1e9 for c in COPIES)
            variants = sorted({name.split()[0] for name in times} - set(COPIES))
            best = {v: t for v in variants if (t := _best(times, v)) is not None}
            moved = spec.bytes_moved(shape, torch_dtype(dtype))
            # An in-place variant allocates nothing: its limit is the in-place copy, not clone.
            limit = {v: copy_gbps if registered[v].inplace else clone_gbps for v in best}
            share = {v: moved / (t * 1e-3) / 1e9 / limit[v] for v, t in best.items()}
            winner = min(best, key=best.__getitem__)
            rows.append([format_shape(shape), dtype, f"{mb:.2f}", f"{clone_gbps:.1f}",
                         f"{copy_gbps:.1f}", winner,
                         *(f"{100 * share[v]:.0f}%" if v in share else "-" for v in variants)])
            out_of_place = {v: f for v, f in share.items() if not registered[v].inplace}
            checks += _targets(f"{format_shape(shape)} {dtype}", mb, shape in default, best,
                               out_of_place, copy_gbps, device, moved)
    headers = ["shape", "dtype", "MB (x)", "clone GB/s", "copy_ GB/s", "fastest",
               *(f"{v} % of {'copy_' if registered[v].inplace else 'clone'}" for v in variants)]
    print(f"\n== {op}: bytes = {spec.bytes_moved.__doc__}")
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    print("targets (ratio; met?)")
    for line in checks:
        print("  " + line)


def _targets(where: str, mb: float, is_default: bool, best: dict[str, float],
             share: dict[str, float], copy_gbps: float, device: Device, moved: int) -> list[str]:
    lines = []
    if device.type == "cpu":
        if mb >= 16:
            top = max(share.values())
            lines.append(f"{where}: best out-of-place lowering {100 * top:.0f}% of clone "
                         f"(>= 85%: {'yes' if top >= 0.85 else 'NO'})")
        others = [t for v, t in best.items() if not _is_cpp(v)]
        for cpp in (v for v in best if _is_cpp(v)):
            ratio = best[cpp] / min(others)
            verdict = ("yes" if ratio <= 1.05 else "NO") if is_default else "not a default shape"
            lines.append(f"{where}: {cpp} / fastest non-C++ = {ratio:.2f} (<= 1.05: {verdict})")
    if device.type == "cuda" and best.get("triton"):
        if mb >= 64:
            gbps = moved / (best["triton"] * 1e-3) / 1e9
            lines.append(f"{where}: triton {100 * gbps / copy_gbps:.0f}% of copy_ "
                         f"(>= 80%: {'yes' if gbps >= 0.8 * copy_gbps else 'NO'})")
        if best.get("compiled"):
            ratio = best["triton"] / best["compiled"]
            lines.append(f"{where}: triton / compiled = {ratio:.2f} "
                         f"(<= 1.10: {'yes' if ratio <= 1.10 else 'NO'})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default=",".join(op_names()), help="comma-separated ops")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="", help="default: each op's defaults + " +
                        EXTRA_SHAPES)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    print(f"{device.hardware_name()}, torch {torch.__version__}")
    for op in parse_list(args.ops, "--ops"):
        run_op(op, args, device)


if __name__ == "__main__":
    main()

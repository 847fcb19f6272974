"""Effective bandwidth of every lowering of each op against this device's own copy bandwidth.

For each op, shape and dtype, in one run: the bandwidth of a fresh-output copy of x (`x.clone()`,
allocation included: the limit for an out-of-place op) and of an in-place copy (`y.copy_(x)`, for
reference), then every available variant at its best tunables (the op's bytes_moved / median
latency) as a share of the clone bandwidth (of copy_ for in-place variants, which allocate
nothing), and the targets as ratios, misses marked NO:
  * the best out-of-place lowering reaches >= 85% of clone bandwidth where x is >= 4 MB, and the
    best in-place one >= 85% of copy_ (CPU);
  * each C++ kernel is within 5% of the fastest non-C++ variant at every default shape (CPU);
  * the Triton kernel reaches >= 80% of copy bandwidth at 64 MB and more and is within 10% of
    torch.compile at every shape (CUDA).
Where an out-of-place cell misses 85% of clone (CPU), its out-of-place lowerings are timed once
more on a cache-resident input of the same row width (x within 1 MiB): if even the fastest of
them stays below 85% of the cell's clone from cache, the cell is compute-bound on this machine,
which no change to memory access can fix; if it does not, memory access (e.g. fresh pages) is
what the kernel must win back.
Every correct configuration is measured; contenders are interleaved over several rounds and the
median of the rounds is kept. In-place variants run on private copies of the inputs.

The copies are measured the way the kernels run: in the same process, with the same threads, and
their fresh outputs come from the same allocator, which on the CPU is pinned as a sweep pins it
(fusionlab/measure/allocator.py `fixed`: glibc's mmap threshold at 128 MiB). Without that, glibc
serves a fresh output of 32 MiB or more by mmap, every call pays its page faults, and whether a
size does so depends on what the process freed before: the clone's figure moved several-fold
between runs. Each figure's spread over the rounds is printed (± half the range, in % of the
median): the share of a copy and the ratio to the fastest other lowering are taken per round.

    python benchmarks/bandwidth.py [--ops rmsnorm,layernorm,add_rmsnorm] [--device cpu]
                                   [--shapes ...] [--dtypes float32,bfloat16] [--rounds 3]
                                   [--variants builtin,compiled,cpp] [--allocator fixed]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch
from tabulate import tabulate

from fusionlab.devices import Device, resolve_device
from fusionlab.measure import allocator
from fusionlab.measure.correctness import check_values
from fusionlab.measure.timing import TimingSettings, time_calls
from fusionlab.op import Inputs, OpSpec, Shape
from fusionlab.registry import get_op, op_names, variants_of
from fusionlab.shapes import format_shape, parse_dtypes, parse_list, parse_shapes, torch_dtype

EXTRA_SHAPES = "2048x4096,4x2048x4096"
CACHE_RESIDENT_BYTES = 1 << 20  # x of the from-cache shape: x and y stay in the caches
SETTINGS = TimingSettings(budget_s=0.2, min_samples=10, checked_calls=0)
COPIES = ("clone", "copy_")
_ALLOCATOR_SET = "FUSIONLAB_BANDWIDTH_ALLOCATOR"  # which setting this process was started under


def _median_ms(call: Callable[[], object], device: Device) -> float:
    return time_calls(lambda index: call(), 1, device.synchronize, SETTINGS).timing.median_ms


def _private(inputs: Inputs) -> Inputs:
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)


def _contenders(spec: OpSpec, dtype: str, device: Device, inputs: Inputs,
                wanted: set[str]) -> dict[str, Callable]:
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
        if wanted and variant.name not in wanted:
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


def measure(spec: OpSpec, shape: Shape, dtype: str, device: Device, rounds: int,
            wanted: set[str]) -> dict[str, list[float]]:
    """Each contender's median latency in ms in each of the interleaved rounds."""
    inputs = spec.make_inputs(shape, torch_dtype(dtype), device.torch_device, 0)
    calls = _contenders(spec, dtype, device, inputs, wanted)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(_median_ms(call, device))
    return samples


def cache_resident_shape(shape: Shape, itemsize: int) -> Shape:
    """The cell's row width with only as many rows as keep x within CACHE_RESIDENT_BYTES (at
    least one row per thread)."""
    width = shape[-1]
    return (max(torch.get_num_threads(), CACHE_RESIDENT_BYTES // (width * itemsize)), width)


def from_cache(spec: OpSpec, shape: Shape, dtype: str, device: Device, rounds: int,
               variants: set[str]) -> tuple[str, float]:
    """The fastest of these variants, each at its fastest configuration, on a cache-resident
    input of the cell's row width, and its effective GB/s: what the cell's lowerings reach with
    no DRAM traffic and no fresh pages, their compute ceiling."""
    small = cache_resident_shape(shape, torch_dtype(dtype).itemsize)
    inputs = spec.make_inputs(small, torch_dtype(dtype), device.torch_device, 0)
    calls = {name: call for name, call in _contenders(spec, dtype, device, inputs, variants).items()
             if name not in COPIES}
    medians = {name: statistics.median(_median_ms(call, device) for _ in range(rounds))
               for name, call in calls.items()}
    fastest = min(medians, key=medians.__getitem__)
    gbps = spec.bytes_moved(small, torch_dtype(dtype)) / (medians[fastest] * 1e-3) / 1e9
    return fastest.split()[0], gbps


def _best(times: dict[str, float], variant: str) -> float | None:
    mine = [t for name, t in times.items() if name.split()[0] == variant]
    return min(mine) if mine else None


def _spread(values: list[float], digits: int = 2, unit: str = "") -> str:
    """The median (with `unit`) and ± half the range in % of it."""
    middle = statistics.median(values)
    return f"{middle:.{digits}f}{unit} ±{50 * (max(values) - min(values)) / middle:.0f}%"


def _per_round(samples: dict[str, list[float]], rounds: int) -> list[dict[str, float]]:
    return [{name: values[r] for name, values in samples.items()} for r in range(rounds)]


def _is_cpp(variant: str) -> bool:
    return variant == "cpp" or variant.startswith("cpp-")


def run_op(op: str, args: argparse.Namespace, device: Device) -> None:
    spec = get_op(op)
    shapes = args.shapes or f"{spec.default_shapes},{EXTRA_SHAPES}"
    default = set(parse_shapes(spec.default_shapes))
    registered = variants_of(op)
    wanted = set(parse_list(args.variants, "--variants")) if args.variants else set()
    rows, checks, variants = [], [], []
    for dtype in parse_dtypes(args.dtypes):
        for shape in dict.fromkeys(parse_shapes(shapes)):
            samples = measure(spec, shape, dtype, device, args.rounds, wanted)
            x_bytes = math.prod(shape) * torch_dtype(dtype).itemsize
            moved = spec.bytes_moved(shape, torch_dtype(dtype))
            rounds = [Round(t, registered, x_bytes, moved)
                      for t in _per_round(samples, args.rounds)]
            variants = sorted({v for r in rounds for v in r.share})
            median = {name: statistics.median(values) for name, values in samples.items()}
            best = {v: t for v in variants if (t := _best(median, v)) is not None}
            winner = min(best, key=best.__getitem__)
            rows.append([format_shape(shape), dtype, f"{x_bytes / 1e6:.2f}",
                         _spread([r.clone_gbps for r in rounds], 1),
                         _spread([r.copy_gbps for r in rounds], 1), winner,
                         *(_spread([100 * r.share[v] for r in rounds], 0, "%") for v in variants)])
            checks += _targets(f"{format_shape(shape)} {dtype}", x_bytes / 1e6, shape in default,
                               rounds, registered, device)
            if device.type == "cpu":
                checks += compute_bound_lines(spec, shape, dtype, device, args.rounds, rounds,
                                              x_bytes)
    headers = ["shape", "dtype", "MB (x)", "clone GB/s", "copy_ GB/s", "fastest",
               *(f"{v} % of {'copy_' if registered[v].inplace else 'clone'}" for v in variants)]
    print(f"\n== {op}: bytes = {spec.bytes_moved.__doc__}")
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))
    print("targets (median over rounds ±half range; met?)")
    for line in checks:
        print("  " + line)


class Round:
    """One round's figures: the copies' GB/s, each variant's best latency and share of its copy."""

    def __init__(self, times: dict[str, float], registered: dict, x_bytes: int, moved: int):
        self.clone_gbps, self.copy_gbps = (2 * x_bytes / (times[c] * 1e-3) / 1e9 for c in COPIES)
        names = {name.split()[0] for name in times} - set(COPIES)
        self.best = {v: t for v in names if (t := _best(times, v)) is not None}
        # An in-place variant allocates nothing: its limit is the in-place copy, not clone.
        self.inplace = {v for v in self.best if registered[v].inplace}
        self.share = {
            v: moved / (t * 1e-3) / 1e9 / (self.copy_gbps if v in self.inplace else self.clone_gbps)
            for v, t in self.best.items()
        }


def _targets(where: str, mb: float, is_default: bool, rounds: list[Round], registered: dict,
             device: Device) -> list[str]:
    """Each target this cell is judged by, as a line: met or not, with its spread over rounds."""
    if device.type == "cpu":
        return _copy_share_targets(where, mb, rounds) + _cpp_ratio_targets(where, is_default,
                                                                           rounds)
    if device.type == "cuda":
        return _triton_targets(where, mb, rounds)
    return []


def _copy_share_targets(where: str, mb: float, rounds: list[Round]) -> list[str]:
    """Where x >= 4 MB: the best lowering's share of the same-run copy (in-place variants
    against the in-place copy), >= 85%."""
    if mb < 4:
        return []
    lines = []
    for inplace, copy in ((False, "clone"), (True, "copy_")):
        tops = [max((f for v, f in r.share.items() if (v in r.inplace) == inplace), default=0.0)
                for r in rounds]
        if max(tops) == 0.0:
            continue
        kind = "in-place" if inplace else "out-of-place"
        share = _spread([100 * t for t in tops], 0, "%")
        met = "yes" if statistics.median(tops) >= 0.85 else "NO"
        lines.append(f"{where}: best {kind} lowering {share} of {copy} (>= 85%: {met})")
    return lines


def compute_bound_lines(spec: OpSpec, shape: Shape, dtype: str, device: Device, rounds: int,
                   per_round: list[Round], x_bytes: int) -> list[str]:
    """For an out-of-place cell that misses 85% of clone: the fastest out-of-place lowering's
    share of the cell's clone when the input is cache-resident. Below 85% even from cache, the
    core's arithmetic, not the memory, is what bounds the cell on this machine."""
    if x_bytes < 4e6:
        return []
    outs = [[f for v, f in r.share.items() if v not in r.inplace] for r in per_round]
    if not outs[0] or statistics.median(max(fs) for fs in outs) >= 0.85:
        return []
    variants = {v for r in per_round for v in r.share if v not in r.inplace}
    variant, gbps = from_cache(spec, shape, dtype, device, rounds, variants)
    ceiling = gbps / statistics.median(r.clone_gbps for r in per_round)
    small = format_shape(cache_resident_shape(shape, torch_dtype(dtype).itemsize))
    bound = "compute-bound here" if ceiling < 0.85 else "not compute-bound: memory access is"
    return [f"{format_shape(shape)} {dtype}: from cache ({small}) the fastest, {variant}, "
            f"reaches {100 * ceiling:.0f}% of this cell's clone ({bound})"]


def _cpp_ratio_targets(where: str, is_default: bool, rounds: list[Round]) -> list[str]:
    """Each C++ variant against the fastest other lowering of the same round, <= 1.05x."""
    lines = []
    for cpp in sorted(v for v in rounds[0].best if _is_cpp(v)):
        ratios = [r.best[cpp] / min(t for v, t in r.best.items() if not _is_cpp(v))
                  for r in rounds if any(not _is_cpp(v) for v in r.best)]
        if not ratios:
            continue
        met = "yes" if statistics.median(ratios) <= 1.05 else "NO"
        verdict = met if is_default else "not a default shape"
        lines.append(f"{where}: {cpp} / fastest non-C++ = {_spread(ratios)} (<= 1.05: {verdict})")
    return lines


def _triton_targets(where: str, mb: float, rounds: list[Round]) -> list[str]:
    """On a GPU: Triton's share of copy_ where x >= 64 MB (>= 80%), and Triton over compiled
    (<= 1.10x)."""
    first = rounds[0]
    if not first.best.get("triton"):
        return []
    lines = []
    triton = statistics.median([r.best["triton"] for r in rounds])
    copy_gbps = statistics.median([r.copy_gbps for r in rounds])
    if mb >= 64:
        gbps = statistics.median([r.share["triton"] * r.clone_gbps for r in rounds])
        lines.append(f"{where}: triton {100 * gbps / copy_gbps:.0f}% of copy_ "
                     f"(>= 80%: {'yes' if gbps >= 0.8 * copy_gbps else 'NO'})")
    if first.best.get("compiled"):
        ratio = triton / statistics.median([r.best["compiled"] for r in rounds])
        lines.append(f"{where}: triton / compiled = {ratio:.2f} "
                     f"(<= 1.10: {'yes' if ratio <= 1.10 else 'NO'})")
    return lines


def _under_allocator(name: str) -> None:
    """Re-run this script with the allocator setting in its environment (glibc reads it at
    start), unless this process already runs under it."""
    if not name or os.environ.get(_ALLOCATOR_SET) == name:
        return
    with allocator.applied(name):
        os.environ[_ALLOCATOR_SET] = name
        os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default=",".join(op_names()), help="comma-separated ops")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="", help="default: each op's defaults + " +
                        EXTRA_SHAPES)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="", help="only these variants (default: all)")
    parser.add_argument("--allocator", default=allocator.DEFAULT,
                        choices=sorted(allocator.SETTINGS), help="host allocator (CPU)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    if device.type == "cpu":
        _under_allocator(args.allocator)
    print(f"{device.hardware_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads for kernels and copies alike, "
          f"allocator {args.allocator if device.type == 'cpu' else '-'}")
    for op in parse_list(args.ops, "--ops"):
        run_op(op, args, device)


if __name__ == "__main__":
    main()

"""What look-alike samples and gap accounting cost a timing loop, and how much room the gap rule
leaves an honest variant.

Prints, from one run, per variant and shape: the loop's wall time (warm-up included), the
sum of its timed windows, this thread's CPU time in the untimed gaps (less the harness's
in-place copies, listed apart), what the gap rule allows there, and the median gap's wall
time. The in-place variant (the test suite's honest control, which writes RMSNorm over its
input) is timed call by call with copies after each call; the others in one window per sample.

    python benchmarks/gap_cost.py [--shapes 8x256,256x4096] [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tabulate import tabulate

from fusionlab.cell import Cell
from fusionlab.measure.inputs import WARM_SETS
from fusionlab.measure.timing import (
    GAP_FACTOR,
    GAP_SHARE,
    GAP_SLACK_S,
    TimingSettings,
    _median,
    time_calls,
)
from fusionlab.measure.trial import _copy_outputs, build_and_gate
from fusionlab.registry import load_plugin
from fusionlab.shapes import parse_dtype, parse_shapes

VARIANTS = [("rmsnorm", "builtin"), ("rmsnorm", "naive"), ("rmsnorm", "honest-in-place")]
HONEST = Path(__file__).parent.parent / "tests" / "plugins" / "gaming_honest.py"


def measure(op: str, variant: str, shape: tuple[int, ...], dtype: str) -> list[str]:
    m, *_ = build_and_gate(Cell(op, "cpu", "this-cpu", shape, dtype), variant, {}, 0)
    args = m.sets.sets[:WARM_SETS]
    inplace = bool(m.variant.inplace)
    loop = time_calls(lambda i: m.kernel(*args[i]), WARM_SETS, m.device.synchronize,
                      TimingSettings(), snapshot=(lambda i: _copy_outputs(args[i])) if inplace
                      else None, keep_copy=_copy_outputs if inplace else None,
                      threads=torch.get_num_threads())
    gaps = loop.gaps
    assert gaps is not None
    count = len(gaps.walls_ns)
    allowed = (GAP_FACTOR * count * gaps.harness_cpu_ns * 1e-9
               + GAP_SHARE * gaps.window_cpu_ns * 1e-9 + GAP_SLACK_S)
    return [f"{op}/{variant}", "x".join(map(str, shape)), "yes" if inplace else "no",
            f"{loop.clock_s * 1e3:.1f}", f"{sum(gaps.windows_ns) * 1e-6:.1f}",
            f"{(gaps.gap_cpu_ns - gaps.copies_cpu_ns) * 1e-6:.2f}",
            f"{gaps.copies_cpu_ns * 1e-6:.1f}", f"{allowed * 1e3:.1f}",
            f"{_median(gaps.walls_ns) * 1e-3:.1f}",
            loop.reason() or "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x256,256x4096")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)
    load_plugin(str(HONEST))
    rows = [measure(op, variant, shape, dtype) for shape in parse_shapes(args.shapes)
            for op, variant in VARIANTS for _ in range(args.repeats)]
    print(tabulate(rows, headers=["variant", "shape", "in place", "loop ms", "windows ms",
                                  "gap CPU ms", "copies CPU ms", "allowed ms",
                                  "median gap us", "verdict"]))


if __name__ == "__main__":
    main()

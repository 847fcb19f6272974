"""What one value check of the gate costs (fusionlab/measure/correctness.py: the audit checks
every sample, so this is its hot path): the float32 comparison it uses for outputs of 32 bits or
fewer beside the float64 one it keeps for tight tolerances, same output, same reference, in one
run. Prints the median of 7 checks of each and their ratio.

    python benchmarks/gate_check.py [--shapes 2048x8192,512x4096] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

from fusionlab.measure import correctness
from fusionlab.registry import get_op
from fusionlab.shapes import DTYPES, parse_shapes


def _median_s(check, repeats: int = 7) -> float:
    check()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        check()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _both_s(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[float, float]:
    """Median seconds of one check of an RMSNorm output: the float32 path, the float64 path."""
    spec = get_op("rmsnorm")
    inputs = spec.make_inputs(shape, dtype, "cpu", 1)
    references = spec.reference(inputs)
    outputs = spec.as_outputs(torch.rms_norm(inputs[0], (shape[-1],), inputs[1], inputs[2]))
    tolerance = spec.tolerance(dtype)

    def check() -> None:
        correctness.check_values(outputs, references, spec, outputs[0], tolerance)

    floor = correctness.FLOAT32_CHECK_FLOOR
    fast = _median_s(check)
    correctness.FLOAT32_CHECK_FLOOR = float("inf")  # every comparison in float64
    try:
        return fast, _median_s(check)
    finally:
        correctness.FLOAT32_CHECK_FLOOR = floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x8192,512x4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    rows = []
    for shape in parse_shapes(args.shapes):
        for name in args.dtypes.split(","):
            fast, slow = _both_s(shape, DTYPES[name])
            rows.append((f"{'x'.join(map(str, shape))} {name}", f"{1e3 * fast:.1f}",
                         f"{1e3 * slow:.1f}", f"{slow / fast:.2f}x"))
    print(tabulate(rows, headers=["output", "float32 check ms", "float64 check ms", "ratio"]))


if __name__ == "__main__":
    main()

"""What one value check of the gate costs (fusionlab/measure/correctness.py: the audit checks
every sample, so this is its hot path): the float32 comparison it uses for outputs of 32 bits or
fewer beside the float64 one it keeps for tight tolerances, and the float32 comparison a block of
CHECK_BLOCK elements at a time (what the gate does) beside the whole tensor in one block; same
output, same reference, in one run. Prints the median of 7 checks of each and the ratios.

    python benchmarks/gate_check.py [--shapes 2048x8192,512x4096,32x4096]
                                    [--dtypes float32,bfloat16]
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


def _timings_s(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[float, float, float]:
    """Median seconds of one check of an RMSNorm output: float32 in blocks (the gate's), float64
    in blocks, float32 with the whole tensor as one block."""
    spec = get_op("rmsnorm")
    inputs = spec.make_inputs(shape, dtype, "cpu", 1)
    references = spec.reference(inputs)
    outputs = spec.as_outputs(torch.rms_norm(inputs[0], (shape[-1],), inputs[1], inputs[2]))
    tolerance = spec.tolerance(dtype)

    def check() -> None:
        correctness.check_values(outputs, references, spec, outputs[0], tolerance)

    floor, block = correctness.FLOAT32_CHECK_FLOOR, correctness.CHECK_BLOCK
    fast = _median_s(check)
    try:
        correctness.FLOAT32_CHECK_FLOOR = float("inf")  # every comparison in float64
        exact = _median_s(check)
        correctness.FLOAT32_CHECK_FLOOR = floor
        correctness.CHECK_BLOCK = outputs[0].numel()  # one block: whole-tensor passes
        return fast, exact, _median_s(check)
    finally:
        correctness.FLOAT32_CHECK_FLOOR, correctness.CHECK_BLOCK = floor, block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x8192,512x4096,32x4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    rows = []
    for shape in parse_shapes(args.shapes):
        for name in args.dtypes.split(","):
            fast, exact, whole = _timings_s(shape, DTYPES[name])
            rows.append((f"{'x'.join(map(str, shape))} {name}", f"{1e3 * fast:.1f}",
                         f"{1e3 * exact:.1f}", f"{exact / fast:.2f}x", f"{1e3 * whole:.1f}",
                         f"{whole / fast:.2f}x"))
    print(tabulate(rows, headers=["output", "float32 check ms", "float64 check ms", "ratio",
                                  "float32, one block ms", "one block / blocks"]))


if __name__ == "__main__":
    main()

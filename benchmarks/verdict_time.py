"""What the paired bootstrap of a cell's verdict costs, next to the re-measurement it decides on.

The decision is made once per cell after its contenders were re-measured in interleaved rounds;
its cost matters only beside those rounds. This prints the median time of `decide()` over
synthetic rounds of 2, 3 and 5 contenders (5 rounds x 20 samples, as a sweep stores them) and
the share it adds to a re-measurement of the same number of contenders at 1 ms per sample.

    python benchmarks/verdict_time.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from fusionlab.verdict import Contender, decide

ROUNDS, SAMPLES, SAMPLE_MS = 5, 20, 1.0


def _contenders(count: int) -> list[Contender]:
    rng = random.Random(count)
    return [
        Contender(f"v{i}", "custom", 1.0,
                  [[(1.0 + 0.05 * i) * rng.lognormvariate(0.0, 0.05) for _ in range(SAMPLES)]
                   for _ in range(ROUNDS)])
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    repeats = parser.parse_args().repeats
    print("contenders  decide() median ms  re-measurement ms  share")
    for count in (2, 3, 5):
        contenders = _contenders(count)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            decide(contenders)
            times.append((time.perf_counter() - start) * 1e3)
        spent = statistics.median(times)
        rounds_ms = count * ROUNDS * SAMPLES * SAMPLE_MS
        print(f"{count:>10}  {spent:>18.2f}  {rounds_ms:>17.0f}  {100 * spent / rounds_ms:>4.1f}%")


if __name__ == "__main__":
    main()

"""The harness's own time per trial: what a sweep spends that is neither timing nor compiling.

Runs a real sweep into a fresh storage and, per trial, splits its wall time (as the sweep process
sees it: from asking the worker to the result being stored) into the trial's phases inside the
worker and the rest (worker round trip, record transfer, storage writes). Harness time = wall -
(timing loops, the screen's brief one included, + setup and first call, where build and
compile live). Target: median <= 0.063 s (before the screen and the busy-machine watch).

    python benchmarks/harness_overhead.py [--op rmsnorm] [--quick] [--shapes ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tabulate import tabulate

from fusionlab.measure.disturbance import Watch
from fusionlab.plan import make_plan
from fusionlab.records import TrialRecord
from fusionlab.search.runner import Sweep
from fusionlab.search.storage import open_storage

MEASURING = ("screen", "warm timing", "cold timing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="rmsnorm")
    parser.add_argument("--shapes")
    parser.add_argument("--dtypes")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    plan = make_plan(args.op, args.shapes, args.dtypes, "cpu", quick=args.quick)
    walls: list[float] = []
    records: list[TrialRecord] = []
    last = [time.perf_counter()]

    def progress(record: TrialRecord, index: int, total: int) -> None:
        now = time.perf_counter()
        walls.append(now - last[0])
        records.append(record)
        last[0] = now

    with tempfile.TemporaryDirectory() as folder:
        storage = open_storage(f"sqlite:///{Path(folder) / 'overhead.db'}")
        sweep = Sweep(
            plan, storage, progress, notice=lambda text: last.__setitem__(0, time.perf_counter())
        )
        start = time.perf_counter()
        sweep.run()
        total = time.perf_counter() - start
        watch_ms, read_ms = _per_trial_additions(sweep)
    phases: dict[str, list[float]] = defaultdict(list)
    harness = []
    for wall, record in zip(walls, records, strict=True):
        first_use = (record.first_use_ms or 0.0) / 1e3
        measuring = sum(record.phases_s.get(name, 0.0) for name in MEASURING) + first_use
        harness.append(wall - measuring)
        phases["outside the worker (round trip, storage)"].append(wall - record.trial_s)
        for name, seconds in record.phases_s.items():
            phases[name].append(seconds)
    rows = [[name, statistics.median(v), max(v), sum(v)] for name, v in phases.items()]
    print(tabulate(rows, headers=["phase", "median s", "max s", "total s"], floatfmt=".3f"))
    print(
        f"\n{len(records)} trials, sweep wall {total:.1f} s "
        f"(confirm rounds and cell set-up included)"
    )
    print(
        f"of it, per trial: the busy-machine watch {watch_ms:.2f} ms CPU, the screen's read of "
        f"its cell from storage {read_ms:.2f} ms CPU"
    )
    print(
        f"harness time per trial (wall - timing loops - setup and first call): median "
        f"{statistics.median(harness):.3f} s, max {max(harness):.3f} s (target <= 0.063 s)"
    )


def _per_trial_additions(sweep: Sweep) -> tuple[float, float]:
    """CPU ms of one busy-machine watch and of one read of the largest cell (the screen's)."""
    repeats = 100
    start = time.process_time()
    for _ in range(repeats):
        Watch().stop()
    watch_ms = 1000 * (time.process_time() - start) / repeats
    largest = max(sweep._cells, key=lambda cell: len(cell.study.trials))
    start = time.process_time()
    for _ in range(repeats // 10):
        sweep._result(largest)
    return watch_ms, 1000 * (time.process_time() - start) / (repeats // 10)


if __name__ == "__main__":
    main()

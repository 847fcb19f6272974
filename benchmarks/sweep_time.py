"""The cold default sweep's wall time and CPU time, with where the time went.

Runs `fusionlab sweep OP` (default shapes and dtypes, this machine's CPU) in this process into a
fresh storage, with empty build caches of its own (FUSIONLAB_CACHE_DIR and
TORCHINDUCTOR_CACHE_DIR point at a new folder, so nobody else's caches are touched), and prints:
the wall time (target <= 120 s on the project's 2-core machine), the CPU time (user + sys of this
process and the worker, less disturbed by other processes than the wall time), and the split:
screen, full measurement, re-measurement, and inside those the C++ builds and inductor's
compiles (set-up and first call of the compiled variants), and what other processes used.

    python benchmarks/sweep_time.py [--op rmsnorm] [--shapes ...] [--dtypes ...] [--no-screen]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from tabulate import tabulate


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _builds_s(cache: Path) -> float:
    log = cache / "builds.log"
    if not log.exists():
        return 0.0
    return sum(float(line.split("\t")[2]) for line in log.read_text().splitlines() if line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="rmsnorm")
    parser.add_argument("--shapes")
    parser.add_argument("--dtypes")
    parser.add_argument("--no-screen", dest="screen", action="store_false")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fusionlab-sweep-time-") as folder:
        root = Path(folder)
        os.environ["FUSIONLAB_CACHE_DIR"] = str(root / "fusionlab")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
        # Imported after the cache folders are set, as a fresh `fusionlab sweep` would start.
        from fusionlab.plan import make_plan
        from fusionlab.records import TrialRecord
        from fusionlab.registry import variants_of
        from fusionlab.search.runner import Sweep
        from fusionlab.search.storage import open_storage

        records: list[TrialRecord] = []
        plan = make_plan(args.op, args.shapes, args.dtypes, "cpu", screen=args.screen)
        storage = open_storage(f"sqlite:///{root / 'sweep.db'}")
        sweep = Sweep(plan, storage, lambda record, index, total: records.append(record))
        cpu, start = _cpu_s(), time.perf_counter()
        sweep.run()
        wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
        builds = _builds_s(root / "fusionlab")
    kinds = {name: v.kind for name, v in variants_of(args.op).items()}
    compiles = sum(
        (r.setup_ms or 0.0) / 1e3 + (r.first_call_ms or 0.0) / 1e3
        for r in records
        if kinds.get(r.variant) == "compiled"
    )
    rows = [
        ["screen", sweep.screen_s, f"{sweep.screened} configurations briefly"],
        ["full measurement", sweep.search_s,
         f"{len(sweep.measured_here) - sweep.screen_saved} configurations"],
        ["re-measurement", sweep.confirm_s,
         f"{sweep.confirmed_here} cells, {sweep.extra_rounds} rounds beyond the minimum "
         f"({sweep.extra_rounds_s:.1f} s)"],
        ["  of which C++ builds", builds, "from the build log of this run's cache"],
        ["  of which inductor compiles", compiles, "set-up + first call of compiled variants"],
        ["other (start-up, planning, storage)", wall - sweep.screen_s - sweep.search_s
         - sweep.confirm_s, ""],
    ]
    print(tabulate(rows, headers=["part", "wall s", "what"], floatfmt=".1f"))
    phases: dict[str, float] = {}
    for record in records:
        for name, seconds in record.phases_s.items():
            phases[name] = phases.get(name, 0.0) + seconds
    print(tabulate(sorted(phases.items(), key=lambda kv: -kv[1]),
                   headers=["phase inside the trials", "wall s"], floatfmt=".1f"))
    line = sweep.closing_line()
    if line:
        print(line)
    warning = sweep.busy_warning()
    print(f"warning: {warning}" if warning else "the machine was quiet during the timings")
    screened = "screened" if args.screen else "no screen"
    print(f"cold sweep of {args.op} ({screened}): wall {wall:.1f} s (target <= 120 s), "
          f"CPU time (user + sys, worker included) {cpu:.1f} s; the screen saved "
          f"{sweep.screen_saved} full measurements")


if __name__ == "__main__":
    main()

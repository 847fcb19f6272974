"""Are the winners stable? The same sweep three times from empty storage, side by side.

Prints, per cell, each run's winner with its runner-up/winner interval and decision, and flags a
cell where two runs name different winners that each claim `faster`: the one outcome a
trustworthy verdict must never produce (an `equivalent` or `inconclusive` cell may name another
variant). Counts, per run, the `inconclusive` cells, the ratios outside their own interval (the
runner-up's, and each vs-baseline ratio: all come from the same interleaved rounds, so none may
be), the figures marked as measured while busy (`!`) and as noisy (`~`), the gate's false
positives (every variant of the default sweep is honest, so any configuration the gate accuses is
one; `unjudged` ones, which accuse nothing, are counted apart), and its wall and CPU time. With
--hog, a busy-loop process per core runs beside every sweep. Exit code 1 when any cell is flagged,
any ratio lies outside its interval or the gate accuses an honest variant.

    python benchmarks/stability.py [--op rmsnorm] [--runs 3] [--hog] [-- extra sweep arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from fusionlab.records import Status
from fusionlab.report.tables import display_rows
from fusionlab.results import WinnerRow, WinnersFile


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


def _hogs(on: bool) -> list[subprocess.Popen]:
    count = len(os.sched_getaffinity(0)) if on else 0
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _outside(row: WinnerRow) -> int:
    """How many of the row's ratios lie outside their own interval."""
    pairs = [(row.ratio, [row.ci_low, row.ci_high])]
    pairs += [(row.speedup_vs_baseline, row.speedup_vs_baseline_ci),
              (row.speedup_vs_builtin, row.speedup_vs_builtin_ci)]
    return sum(
        1 for value, interval in pairs
        if value is not None and interval is not None and None not in interval
        and not interval[0] <= value <= interval[1]
    )


# What the gate says of a variant it believes cheats or computes wrong values.
ACCUSING = {Status.INCORRECT, Status.STALE_RESULT, Status.REUSED_MEMORY, Status.SUSPICIOUS,
            Status.INCONSISTENT}


def _accused(rows: list[WinnerRow], statuses: set[Status]) -> dict[str, int]:
    """Configurations ended with one of `statuses`, by status, over the run's cells."""
    counts: dict[str, int] = {}
    for row in rows:
        for status, count in row.failures.items():
            if Status(status) in statuses:
                counts[status] = counts.get(status, 0) + count
    return counts


def _run(
    op: str, folder: Path, index: int, extra: list[str]
) -> tuple[list[WinnerRow], float, float]:
    """One sweep's typed rows, its wall time and its children's CPU time."""
    url = f"sqlite:///{folder / f'run{index}.db'}"
    out = folder / f"run{index}.json"
    start, cpu = time.perf_counter(), _children_cpu_s()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fusionlab.cli",
            "sweep",
            op,
            "--device",
            "cpu",
            "--storage",
            url,
            "--export",
            str(out),
            *extra,
        ],
        check=True,
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rows = WinnersFile.from_dict(json.loads(out.read_text())).rows
    return rows, time.perf_counter() - start, _children_cpu_s() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="rmsnorm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hog", action="store_true", help="a busy-loop process on every core")
    parser.add_argument("extra", nargs="*", help="more `fusionlab sweep` arguments, after --")
    args = parser.parse_args()
    runs, summary, outside, accused = [], [], 0, 0
    hogs = _hogs(args.hog)
    try:
        with tempfile.TemporaryDirectory() as name:
            for index in range(args.runs):
                typed, seconds, cpu = _run(args.op, Path(name), index, args.extra)
                runs.append(display_rows(typed, args.op))
                unsure = sum(row.decision == "inconclusive" for row in typed)
                wrong = sum(_outside(row) for row in typed)
                outside += wrong
                false_positives = _accused(typed, ACCUSING)
                accused += sum(false_positives.values())
                unjudged = _accused(typed, {Status.UNJUDGED})
                summary.append(
                    f"run {index + 1}: wall {seconds:.1f} s, CPU {cpu:.1f} s, {unsure} of "
                    f"{len(typed)} cells inconclusive, {wrong} ratios outside their interval, "
                    f"{sum(len(row.disturbed) for row in typed)} figures marked busy (!), "
                    f"{sum(len(row.noisy) for row in typed)} marked noisy (~), "
                    f"{sum(false_positives.values())} honest configurations accused"
                    f"{f' {false_positives}' if false_positives else ''}, "
                    f"{sum(unjudged.values())} unjudged"
                )
                print(summary[-1], file=sys.stderr)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    table, flagged = [], 0
    for cells in zip(*runs, strict=True):
        winners = {row["fastest"] for row in cells}
        claimed = {row["fastest"] for row in cells if row["decision"].rstrip("!") == "faster"}
        bad = len(claimed) > 1
        flagged += bad
        table.append(
            [
                cells[0]["shape"],
                cells[0]["dtype"],
                *(
                    f"{r['fastest']} {r['runner-up/winner [95% CI]']} {r['decision']}"
                    for r in cells
                ),
                "CONTRADICTION" if bad else ("same" if len(winners) == 1 else "differs, unclaimed"),
            ]
        )
    headers = ["shape", "dtype", *(f"run {i + 1}" for i in range(args.runs)), "verdict"]
    print(tabulate(table, headers=headers, tablefmt="simple"))
    print("\n".join(summary) + (" (with a busy-loop process on every core)" if args.hog else ""))
    print(f"{flagged} of {len(table)} cells name two different winners that each claim `faster`")
    print(f"{outside} ratios outside their own interval over {args.runs} runs")
    print(f"{accused} honest configurations accused by the gate over {args.runs} runs")
    return 1 if flagged or outside or accused else 0


if __name__ == "__main__":
    sys.exit(main())

"""Are the winners stable? The same sweep three times from empty storage, side by side.

Prints, per cell, each run's winner with its runner-up/winner interval and decision, and flags a
cell that names different winners while some run claims a confident (non-tie) margin: the one
outcome a trustworthy verdict must never produce. Exit code 1 when any cell is flagged.

    python benchmarks/stability.py [--op rmsnorm] [--runs 3] [-- extra sweep arguments]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate


def _run(op: str, folder: Path, index: int, extra: list[str]) -> tuple[list[dict], float]:
    url = f"sqlite:///{folder / f'run{index}.db'}"
    out = folder / f"run{index}.json"
    start = time.perf_counter()
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
    return json.loads(out.read_text())["rows"], time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="rmsnorm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more `fusionlab sweep` arguments, after --")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as name:
        for index in range(args.runs):
            rows, seconds = _run(args.op, Path(name), index, args.extra)
            runs.append(rows)
            print(f"run {index + 1}: {seconds:.1f} s", file=sys.stderr)
    table, flagged = [], 0
    for cells in zip(*runs, strict=True):
        winners = {row["fastest"] for row in cells}
        confident = any(row.get("decision") == "confident" for row in cells)
        bad = len(winners) > 1 and confident
        flagged += bad
        table.append(
            [
                cells[0]["shape"],
                cells[0]["dtype"],
                *(
                    f"{r['fastest']} {r.get('ratio') or ''} {r.get('decision') or ''}"
                    for r in cells
                ),
                "CONTRADICTION" if bad else ("same" if len(winners) == 1 else "differs, all ties"),
            ]
        )
    headers = ["shape", "dtype", *(f"run {i + 1}" for i in range(args.runs)), "verdict"]
    print(tabulate(table, headers=headers, tablefmt="simple"))
    print(f"{flagged} of {len(table)} cells name different winners with a confident margin")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())

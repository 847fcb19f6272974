"""`compare` and `sweep` measure one cell through the same plan, worker, allocator and timing,
so they cannot disagree beyond their intervals."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import run_cli
from helpers import sqlite_url

CELL = ["rmsnorm", "--variants", "naive,builtin"]
SHAPE, DTYPE = "64x4096", "float32"


def _compare_medians(output: str) -> dict[str, tuple[float, float]]:
    """variant -> (warm median ms, relative IQR) from compare's summary table."""
    found = {}
    for name, median, iqr in re.findall(
        r"^(naive|builtin)\s+passed\s+(?:\S+\s+)?([\d.e+-]+) ±(\d+)%", output, re.MULTILINE
    ):
        found[name] = (float(median), float(iqr) / 100)
    return found


def test_compare_and_sweep_agree_on_a_fixed_cell(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "agree.db")
    swept = run_cli("sweep", *CELL, "--shapes", SHAPE, "--dtypes", DTYPE, "--rank-by", "warm",
                    "--storage", url, "--export", "rows.json", cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr[-2000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())["rows"]
    compared = run_cli("compare", *CELL, "--shape", SHAPE, "--dtype", DTYPE, "--wide",
                       cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr[-2000:]
    assert "malloc fixed" in compared.stdout and "malloc fixed" in swept.stderr
    medians = _compare_medians(compared.stdout)
    assert set(medians) == {"naive", "builtin"}, compared.stdout
    fastest = min(medians, key=lambda name: medians[name][0])
    slower = max(medians, key=lambda name: medians[name][0])
    # Each median +- its IQR: overlapping when the slower one's low end reaches the faster's top.
    (fast_ms, fast_iqr), (slow_ms, slow_iqr) = medians[fastest], medians[slower]
    overlapping = slow_ms * (1 - slow_iqr) <= fast_ms * (1 + fast_iqr)
    assert row["decision"] in {"faster", "equivalent", "inconclusive"}
    if row["decision"] == "faster" and not overlapping:
        assert row["variant"] == fastest, (row, medians)

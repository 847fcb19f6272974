"""The report's figures, drawn with matplotlib from stored cells: latency and share of the copy
limit against rows, one line per variant, and the winners over shapes x dtypes."""

from __future__ import annotations

import io
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from fusionlab.results import CellResult, WinnerRow
from fusionlab.shapes import format_shape

plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "fusionlab"})  # text stays text


@dataclass
class Plot:
    """One figure and the file name it is saved under (without extension)."""

    name: str
    title: str
    figure: Figure

    def svg(self) -> str:
        """The figure as an inline <svg> element (no XML prologue)."""
        buffer = io.StringIO()
        self.figure.savefig(buffer, format="svg", bbox_inches="tight")
        text = buffer.getvalue()
        return text[text.index("<svg") :]

    def save(self, folder: str) -> list[str]:
        paths = []
        for ext in ("svg", "png"):
            path = f"{folder}/{self.name}.{ext}"
            self.figure.savefig(path, format=ext, bbox_inches="tight", dpi=110)
            paths.append(path)
        return paths


def _rows(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1])


def _colors(variants: list[str]) -> dict[str, Any]:
    palette = plt.get_cmap("tab10")
    return {name: palette(i % 10) for i, name in enumerate(variants)}


def scaling_plots(cells: list[CellResult], mode: str, variants: list[str]) -> list[Plot]:
    """Per (hidden size, dtype): latency and % of the copy limit against rows, per variant."""
    groups: dict[tuple[int, str], list[CellResult]] = defaultdict(list)
    for cell in cells:
        groups[(cell.cell.shape[-1], cell.cell.dtype)].append(cell)
    colors = _colors(variants)
    plots = []
    for (hidden, dtype), group in sorted(groups.items()):
        group.sort(key=lambda c: _rows(c.cell.shape))
        figure, (latency, share) = plt.subplots(1, 2, figsize=(10, 3.6))
        for variant in variants:
            points = []
            for cell in group:
                record = cell.best_per_variant(mode).get(variant)
                timing = record.timing_for(mode) if record is not None else None
                if record is None or timing is None:
                    continue
                limit = record.limit_share(mode)
                points.append(
                    (
                        _rows(cell.cell.shape),
                        timing.median_ms,
                        timing.q1_ms,
                        timing.q3_ms,
                        None if limit is None else 100 * min(limit.values()),
                    )
                )
            if not points:
                continue
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            errors = [
                [y - p[2] for y, p in zip(ys, points, strict=True)],
                [p[3] - y for y, p in zip(ys, points, strict=True)],
            ]
            latency.errorbar(
                xs, ys, yerr=errors, marker="o", capsize=3, label=variant, color=colors[variant]
            )
            shares = [(x, p[4]) for x, p in zip(xs, points, strict=True) if p[4] is not None]
            if shares:
                xs_shown, percents = zip(*shares, strict=True)
                share.plot(xs_shown, percents, marker="o", label=variant, color=colors[variant])
        for axes in (latency, share):
            axes.set_xscale("log", base=2)
            axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axes.set_xlabel("rows")
            axes.grid(True, which="both", alpha=0.3)
        latency.set_yscale("log")
        latency.set_ylabel(f"{mode} median latency (ms), IQR bars")
        latency.set_title(f"latency, hidden {hidden}, {dtype}")
        share.set_ylabel("% of the device's copy limit")
        share.set_title(f"bandwidth as % of the copy limit, hidden {hidden}, {dtype}")
        latency.legend(fontsize="small")
        figure.tight_layout()
        plots.append(Plot(f"scaling-h{hidden}-{dtype}", f"hidden {hidden}, {dtype}", figure))
    return plots


def winners_plot(
    cells: list[CellResult], rows: list[WinnerRow], variants: list[str], baseline: str
) -> Plot:
    """A heat-map of the winner over shapes (rows) x dtypes (columns), labelled with its speed-up
    over the baseline."""
    shapes = sorted({c.cell.shape for c in cells}, key=lambda s: (s[-1], _rows(s)))
    dtypes = sorted({c.cell.dtype for c in cells})
    names = ["none passed", *variants]
    colors = ["#dddddd", *(_colors(variants)[v] for v in variants)]
    grid = [[0] * len(dtypes) for _ in shapes]
    labels = [[""] * len(dtypes) for _ in shapes]
    for cell, row in zip(cells, rows, strict=True):
        i, j = shapes.index(cell.cell.shape), dtypes.index(cell.cell.dtype)
        winner, speedup = row.variant, row.speedup_vs_baseline
        grid[i][j] = names.index(winner) if winner in names else 0
        labels[i][j] = (
            (winner or "none passed")
            + (f"\n{speedup:.2f}x vs {baseline}" if speedup else "")
            + (f"\n{row.decision}" if row.decision else "")
        )
    figure, axes = plt.subplots(figsize=(2.2 + 2.4 * len(dtypes), 0.9 + 0.55 * len(shapes)))
    axes.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=len(names) - 1, aspect="auto")
    axes.set_xticks(range(len(dtypes)), dtypes)
    axes.set_yticks(range(len(shapes)), [format_shape(s) for s in shapes])
    for i in range(len(shapes)):
        for j in range(len(dtypes)):
            axes.text(j, i, labels[i][j], ha="center", va="center", fontsize=8)
    axes.set_title("winner per cell")
    figure.tight_layout()
    return Plot("winners", "winners over shapes x dtypes", figure)

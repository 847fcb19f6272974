"""`fusionlab report`: one self-contained HTML page of an op's stored results (inline SVG plots,
inline CSS, no script, nothing fetched at view time)."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Sequence
from html import escape
from typing import Any

import matplotlib.pyplot as plt
import torch

from fusionlab.records import TrialRecord
from fusionlab.registry import get_op, variants_of
from fusionlab.report.plots import Plot, scaling_plots, winners_plot
from fusionlab.report.tables import best_rows, texts_by_key
from fusionlab.results import CellResult, WinnerRow

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1180px; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.winner td { background: #eef7ee; font-weight: 600; }
figure { margin: 1em 0; } figure svg { max-width: 100%; height: auto; }
.decision { margin: 0.3em 0 1.2em; } .muted { color: #666; }
"""


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] = ()
) -> str:
    """An HTML table; numbers are right-aligned, every value escaped."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for index, row in enumerate(rows):
        cls = f' class="{classes[index]}"' if index < len(classes) and classes[index] else ""
        cells = "".join(
            f'<td class="num">{escape(v)}</td>' if _is_number(v) else f"<td>{escape(str(v))}</td>"
            for v in row
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _is_number(value: Any) -> bool:
    text = str(value).rstrip("x%").split(" ")[0]
    try:
        float(text)
    except ValueError:
        return False
    return True


def _variants(op: str, cells: list[CellResult]) -> list[str]:
    """Variants present in the results, in the registry's order (plugins' after)."""
    seen = {r.variant for cell in cells for r in cell.records}
    ordered = [name for name in variants_of(op) if name in seen]
    return ordered + sorted(seen - set(ordered))


def _cell_section(cell: CellResult, row: WinnerRow, shown: dict[str, str], mode: str) -> str:
    """Every variant's best configuration in one cell: latency with its IQR, the re-measured
    latency and ratio to the fastest with its interval, bandwidth and fusion accounting."""
    verdict = cell.verdicts.get(mode)
    remeasured = verdict.latency_ms if verdict is not None else {}
    versus = verdict.versus_fastest if verdict is not None else {}
    rows, classes = [], []
    for record in cell.best_per_variant(mode).values():
        label = record.config_label()
        timing = record.timing_for(mode)
        assert timing is not None  # best_per_variant holds passing records only
        share = record.limit_share(mode)
        fusion = record.fusion
        ratio = versus.get(label)
        rows.append(
            [
                label,
                _num(timing.median_ms),
                f"[{_num(timing.q1_ms)}, {_num(timing.q3_ms)}]",
                _num(remeasured.get(label)),
                "-" if not ratio else f"{ratio[0]:.2f}x [{ratio[1]:.2f}, {ratio[2]:.2f}]",
                _num(record.gbps(mode)),
                "-" if share is None else f"{100 * min(share.values()):.0f}%",
                _num(record.first_use_ms),
                "-" if fusion is None else f"{fusion.device_ops:g}",
                "-"
                if fusion is None or fusion.idle_us is None
                else f"{fusion.idle_us:.1f} ({100 * (fusion.idle_share or 0):.0f}%)",
                "-" if fusion is None else _num(fusion.memory_bytes / 1e6),
            ]
        )
        classes.append("winner" if record.variant == row.variant else "")
    unit = next((r.fusion.unit for r in cell.records if r.fusion), "device op")
    table = _table(
        [
            "variant (best configuration)",
            f"{mode} median ms",
            "IQR ms",
            "re-measured ms",
            "vs fastest [95% CI]",
            "GB/s",
            "% copy limit",
            "first use ms",
            f"{unit}s/call",
            "idle us (share)",
            "MB/call",
        ],
        rows,
        classes,
    )
    ratio = shown["ratio"]
    reason = row.reason or (f"runner-up/winner {ratio}" if ratio != "-" else "")
    return (
        f"<h3>{escape(cell.cell.label)} <span class='muted'>on "
        f"{escape(cell.cell.device_name)}</span></h3>{table}"
        f"<p class='decision'><b>decision: {escape(shown['decision'])}</b> {escape(reason)}</p>"
    )


def _failures(cells: list[CellResult]) -> str:
    rows = [
        [cell.cell.label, record.config_label(), record.status.value, record.message[:400]]
        for cell in cells
        for record in cell.failures()
    ]
    if not rows:
        return "<p>No trial failed.</p>"
    return _table(["cell", "configuration", "status", "reason"], rows)


def _environment(cells: list[CellResult]) -> str:
    rows = [["python", platform.python_version()], ["platform", platform.platform()]]
    rows.append(["torch (rendering this report)", torch.__version__])
    seen: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for cell in cells:
        key = (cell.cell.device_name, tuple(sorted(cell.cell.toolchain.items())))
        if key not in seen:
            seen.append(key)
    for device, toolchain in seen:
        rows.append(["device", device])
        rows.extend([f"  {name}", value] for name, value in toolchain)
    return _table(["what", "value"], rows)


def _trial_time(records: list[TrialRecord]) -> float:
    return sum(r.trial_s for r in records)


def _figures(plots: list[Plot], plots_dir: str | None) -> tuple[str, list[str]]:
    """The plots as inline SVG, and the files written when `plots_dir` is given."""
    parts, saved = [], []
    for plot in plots:
        parts.append(
            f"<figure id='{escape(plot.name)}'>{plot.svg()}"
            f"<figcaption>{escape(plot.title)}</figcaption></figure>"
        )
        if plots_dir is not None:
            saved.extend(plot.save(plots_dir))
        plt.close(plot.figure)
    return "".join(parts), saved


def render(
    op: str, cells: list[CellResult], mode: str, storage: str, plots_dir: str | None = None
) -> tuple[str, list[str]]:
    """The page, and the plot files written to `plots_dir` (SVG and PNG) when it is given."""
    spec = get_op(op)
    rows = best_rows(cells, mode)
    shown = texts_by_key(rows, op)
    variants = _variants(op, cells)
    plots = [
        winners_plot(cells, rows, variants, spec.baseline),
        *scaling_plots(cells, mode, variants),
    ]
    figures, saved = _figures(plots, plots_dir)
    devices = sorted({c.cell.device_name for c in cells})
    records = [r for c in cells for r in c.records]
    summary = _table(
        [
            "shape",
            "dtype",
            "winner",
            "params",
            f"{mode} ms",
            f"vs {spec.baseline}",
            f"vs {spec.builtin}",
            "decision",
            "runner-up/winner [95% CI]",
            "failed",
        ],
        [
            [
                text[key]
                for key in ("shape", "dtype", "fastest", "params", "median_ms",
                            "speedup_vs_baseline", "speedup_vs_builtin", "decision", "ratio",
                            "failed")
            ]
            for text in shown
        ],
    )
    generated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fusionlab report: {escape(op)}</title><style>{_STYLE}</style></head>
<body>
<h1>fusionlab report: {escape(op)}</h1>
<p>{escape(spec.description)}. Measured on {escape(", ".join(devices))}; {len(cells)} cells,
{len(records)} configurations measured ({_trial_time(records):.0f} s of trials), ranked by the
{escape(mode)} median. Storage <code>{escape(storage)}</code>; generated {generated}.</p>
<h2>Winners</h2>
{summary}
<h2>Plots</h2>
{figures}
<h2>Every variant, per cell</h2>
<p class="muted">The best configuration of each variant; IQR = interquartile range of the samples;
re-measured = median of the round medians of the interleaved re-measurement, with the ratio to the
fastest and its 95% bootstrap interval; % copy limit = achieved GB/s over the faster of this
device's two copies at the same size, measured in the same run; fusion accounting from
torch.profiler.</p>
{"".join(_cell_section(*parts, mode) for parts in zip(cells, rows, shown, strict=True))}
<h2>Failures</h2>
{_failures(cells)}
<h2>Environment and toolchain</h2>
{_environment(cells)}
</body></html>
"""
    return page, saved

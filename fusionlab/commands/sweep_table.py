"""The table a sweep ends with: the best configuration per cell and the notes that explain it."""

from __future__ import annotations

from fusionlab.report import fit
from fusionlab.report.tables import BUSY_MARK, NOISY_IQR, ROUGH_DIGITS, best_rows, terminal_table
from fusionlab.results import CellResult

RANKING_NOTE = (
    "ranked by the {mode} median ({why}); contenders within 10% were re-measured in interleaved "
    "rounds (at least 5, more while undecided, 3 s a cell): runner-up/winner with a 95% bootstrap "
    "interval; faster: above 1.03, equivalent: inside [0.97, 1.03], inconclusive: neither (the "
    "better point estimate is named); equivalent ones go to the simpler lowering (builtin, "
    "baseline, compiled, custom), then the lower first-use cost. % copy = achieved GB/s over "
    "this device's copy bandwidth at the same size, measured in this run (fresh output with "
    "allocation / into an existing buffer)."
)
BUSY_NOTE = (
    f"{BUSY_MARK} after a figure: measured while other processes used more than a quarter of "
    "the cores, still so after re-measuring: slower and noisier than on a quiet machine (run "
    "again when the machine is quiet)"
)
NOISY_NOTE = (
    f"~ before a figure: its timing's IQR is above {100 * NOISY_IQR:.0f}% of its median, so it "
    f"keeps {ROUGH_DIGITS} significant digits (the IQR % column says how noisy)"
)
_WHY = {
    "cold": "inputs rotated past the last-level cache, as an op meets them inside a model",
    "warm": "two input sets that stay in cache: the best case, asked for with --rank-by warm",
}


def print_table(
    cells: list[CellResult],
    op: str,
    mode: str,
    calls: int | None,
    wide: bool = False,
    chosen: str | None = None,
    memory_budget_mb: float | None = None,
) -> None:
    """The best-config table and its notes, fitted to the terminal's width."""
    width = fit.terminal_width()
    devices = sorted({cell.cell.device_label for cell in cells})
    rows = best_rows(cells, mode, calls, memory_budget_mb)
    text, left_out = terminal_table(rows, op, width, wide, chosen, with_device=len(devices) > 1)
    print(text)
    notes = [f"  {row.shape} {row.dtype}: {row.reason}" for row in rows if row.reason]
    for cell in cells:
        notes.extend(
            f"  failed: {cell.cell.label} {record.config_label()}: "
            f"{record.status.value}: {record.message[:160]}"
            for record in cell.failures()
        )
    if any(row.disturbed for row in rows):
        notes.append(BUSY_NOTE)
    if any(row.noisy for row in rows):
        notes.append(NOISY_NOTE)
    notes.append(_ranking_note(mode, calls, memory_budget_mb))
    if left_out:
        notes.append(f"more columns: --wide, or --columns with any of {', '.join(left_out)}")
    for line in notes:
        print(fit.wrap(line.strip(), width, indent=line[: len(line) - len(line.lstrip())]))


def _ranking_note(mode: str, calls: int | None, memory_budget_mb: float | None) -> str:
    """How the rows were ranked: --rank-by, --calls and --memory-budget in words."""
    note = RANKING_NOTE.format(mode=mode, why=_WHY[mode])
    if calls is not None:
        note = f"ranked by first use + {calls} x {mode} latency (--calls); " + note
    if memory_budget_mb is not None:
        note = (f"backward rows: only configurations whose footprint, max(fwd peak, saved + bwd "
                f"peak), is at most {memory_budget_mb:g} MB compete (--memory-budget); " + note)
    return note

"""A sweep's progress on stderr: a tqdm bar with an ETA on a terminal, one line per trial
elsewhere (logs, CI, several workers)."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from fusionlab.cell import Cell
from fusionlab.records import TrialRecord
from fusionlab.report.fit import terminal_width
from fusionlab.shapes import format_shape

_BAR = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} configs [{elapsed}{postfix}]"
TrialLine = Callable[[TrialRecord, int, int], None]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class SweepProgress:
    """Hooks for a Sweep (`trial`, `starting`, `cell_done`, `say`); `close` before the table.

    The ETA is the mean wall time of the configurations measured in this run, times the
    configurations left (re-measurement of contenders comes on top)."""

    def __init__(self, cells: int, line: TrialLine, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.cells = cells
        self.line = line
        self.interactive = self.stream.isatty()
        self.bar: tqdm | None = None
        self.decided = 0
        self.done = 0
        self.total = 0
        self.durations: list[float] = []
        self.current = ""
        self.started_at: float | None = None

    def begin(self, done: int, total: int) -> None:
        """What the sweep starts from: configurations already measured, and planned."""
        self.done, self.total = done, total

    def starting(self, cell: Cell, variant: str, params: dict[str, object]) -> None:
        """A measurement begins: show what runs now."""
        inner = " ".join(f"{k}={v}" for k, v in params.items())
        self.current = f"{cell.label} {variant} {inner}".strip()
        self.started_at = time.perf_counter()
        self._show()

    def trial(self, record: TrialRecord, done: int, total: int) -> None:
        """A configuration's measurement ended (the Sweep's `progress`)."""
        if self.started_at is not None:
            self.durations.append(time.perf_counter() - self.started_at)
            self.started_at = None
        self.done, self.total = done, total
        if not self.interactive:
            self.line(record, done, total)
            return
        if not record.passed:
            self.say(
                f"failed: {format_shape(record.shape)} {record.dtype} {record.config_label()}: "
                f"{record.status.value}: {record.message[:160]}"
            )
        self._show()

    def cell_done(self, cell: Cell) -> None:
        self.decided += 1
        self._show()

    def say(self, text: str) -> None:
        """A notice: above the bar on a terminal, a plain line elsewhere."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def eta_s(self) -> float | None:
        if not self.durations:
            return None
        return sum(self.durations) / len(self.durations) * max(self.total - self.done, 0)

    def _show(self) -> None:
        if not self.interactive:
            return
        if self.bar is None:
            self.bar = tqdm(
                total=max(self.total, 1),
                file=self.stream,
                ncols=terminal_width(),
                nrows=shutil.get_terminal_size((80, 24)).lines,  # an unsized pty reads as 0 rows
                unit="config",
                bar_format=_BAR,
            )
        eta = self.eta_s()
        self.bar.ncols = terminal_width()  # $COLUMNS first, as the tables; tqdm asks the tty only
        self.bar.total = max(self.total, self.done, 1)
        self.bar.n = self.done
        self.bar.set_postfix_str(
            f"ETA {'?' if eta is None else _clock(eta)}; cells decided {self.decided}/"
            f"{self.cells}; now {self.current or '-'}",
            refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        """Leave the bar's last state on its own line, so the table never mixes with it."""
        if self.bar is not None:
            self.current = "done"
            self._show()
            self.bar.close()
            self.bar = None

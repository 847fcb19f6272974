"""What else ran on the machine while something was timed, so a disturbed sample is marked.

A `Watch` reads, at its start and stop, the busy CPU time of the cores this process may run on
(/proc/stat) and this process's own CPU time (os.times: every thread, and children it waited
for). The difference is what other processes used during the window; its share of the window's
capacity (wall x cores) says how busy the machine was. The 1-minute load average and the CPU
clock (cpufreq, else /proc/cpuinfo) are recorded beside it where readable. Linux only: elsewhere
a watch reports nothing (None) and nothing is marked.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fusionlab.records import BusyWindow

BUSY_SHARE = 0.25
"""A window is disturbed when other processes used more than a quarter of its CPU capacity on
this process's cores: enough to deschedule one of two threads for a quarter of the time."""

BUSY_NOTE = "measured while the machine was busy"

_STAT = Path("/proc/stat")
_CPUINFO = Path("/proc/cpuinfo")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest is within user)


@dataclass(frozen=True)
class Disturbance:
    """What other processes did during one window."""

    wall_s: float
    other_cpu_s: float  # CPU seconds other processes used on this process's cores
    other_share: float  # other_cpu_s / (wall_s x cores)
    load: float  # 1-minute load average at the end
    mhz: float | None  # mean CPU clock of these cores at the end, where readable

    @property
    def disturbed(self) -> bool:
        return self.other_share > BUSY_SHARE

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "disturbed": self.disturbed}

    def window(self) -> BusyWindow:
        """As a record keeps it (one attempt)."""
        return BusyWindow(**asdict(self), disturbed=self.disturbed)


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _busy_s(cores: list[int]) -> float | None:
    """Busy CPU seconds since boot of these cores, or None where /proc/stat is unreadable."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{core}" for core in cores}
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            values = rest.split()
            ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks * _TICK_S


def _own_s() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _mhz(cores: list[int]) -> float | None:
    readings = []
    for core in cores:
        path = Path(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_cur_freq")
        try:
            readings.append(int(path.read_text()) / 1000)
        except (OSError, ValueError):
            break
    if len(readings) == len(cores) and readings:
        return statistics.fmean(readings)
    try:
        lines = _CPUINFO.read_text().splitlines()
    except OSError:
        return None
    values = [float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")]
    return statistics.fmean(values) if values else None


class Watch:
    """Started on creation; `stop()` says what other processes did since (None off Linux)."""

    def __init__(self) -> None:
        self._cores = _cores()
        self._busy = _busy_s(self._cores)
        self._own = _own_s()
        self._wall = time.perf_counter()

    def stop(self) -> Disturbance | None:
        wall = time.perf_counter() - self._wall
        busy = _busy_s(self._cores)
        if busy is None or self._busy is None or not self._cores:
            return None
        other = max(0.0, (busy - self._busy) - (_own_s() - self._own))
        capacity = max(wall, _TICK_S) * len(self._cores)
        return Disturbance(wall, other, min(other / capacity, 1.0), os.getloadavg()[0],
                           _mhz(self._cores))


def mark_busy(note: str, seen: Disturbance | None) -> str:
    """`note` with BUSY_NOTE and the figure added when the window was disturbed."""
    if seen is None or not seen.disturbed:
        return note
    mark = f"{BUSY_NOTE} (others used {100 * seen.other_share:.0f}% of its cores)"
    return f"{note}; {mark}" if note else mark


def window_of(seen: dict[str, Any], attempts: int) -> BusyWindow | None:
    """A window's figures (`Disturbance.to_dict`) as a trial record keeps them, with the
    timings it took; None where nothing was readable (`seen` empty)."""
    return BusyWindow.from_dict({**seen, "attempts": attempts}) if seen else None


def summary(seen: Sequence[BusyWindow], touched: Sequence[str] = ()) -> str | None:
    """One line for a sweep that saw disturbed windows, with the figure and the rows they
    touched; None when quiet."""
    disturbed = [s for s in seen if s.disturbed]
    if not disturbed:
        return None
    share = statistics.median(s.other_share for s in seen)
    worst = max(s.other_share for s in seen)
    load = max(s.load for s in seen)
    rows = f" (rows: {', '.join(dict.fromkeys(touched))})" if touched else ""
    return (
        f"the machine was busy: other processes used {100 * share:.0f}% of this sweep's cores "
        f"(median over {len(seen)} timed windows, up to {100 * worst:.0f}%; load average up to "
        f"{load:.1f}); {len(disturbed)} windows were above {100 * BUSY_SHARE:.0f}%{rows}: their "
        "timings are slower and noisier than on a quiet machine"
    )

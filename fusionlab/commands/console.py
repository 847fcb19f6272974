"""What commands say on stderr while they work: notes, warnings and one line per trial."""

from __future__ import annotations

import sys

from fusionlab.records import TrialRecord
from fusionlab.report.tables import BUSY_MARK
from fusionlab.shapes import format_shape


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _busy(record: TrialRecord) -> str:
    """`  busy!` and the figure when the trial's timing stayed disturbed after re-measuring."""
    seen = record.disturbance
    if seen is None or not seen.disturbed:
        return ""
    return (f"  busy{BUSY_MARK} others used {100 * seen.other_share:.0f}% of the cores "
            f"({seen.attempts} attempts)")


def trial_line(record: TrialRecord, index: int, total: int, prefix: str = "") -> None:
    """One progress line per measured configuration."""
    where = f"{prefix}[{index}/{total}] {format_shape(record.shape)} {record.dtype:<8}"
    if record.passed and record.timing is not None:
        cold = f", cold {record.cold.median_ms:.4g} ms" if record.cold is not None else ""
        detail = (
            f"warm {record.timing.median_ms:.4g} ms ±{100 * record.timing.relative_iqr:.1f}%"
            f"{cold}  first use {record.first_use_ms or 0:.4g} ms{_busy(record)}"
        )
    else:
        detail = f"{record.status.value.upper()}: {record.message}"
    say(f"{where} {record.config_label():<44} {detail}")

"""Figures that cannot be true: a norms' share above 100%, a saving larger than all the norms'
time, a ratio between two lowerings of one memory-bound norm far beyond what any device does.
Such a figure comes from timings other processes disturbed; it is marked, never printed plain."""

from __future__ import annotations

# Two lowerings of one norm read and write the same bytes; at most the launches and passes of a
# naive chain (about ten ops) separate them. A hundredfold gap is disturbance, not a kernel.
MAX_RATIO = 100.0
# Timing noise allowed before a saving counts as larger than all the norms' time.
SAVING_SLACK = 1.10
MARK = " [disturbed]"


def share_problem(share: float) -> str:
    """Why a norms' share of a step cannot be true ("" when it can)."""
    if share > 1.0:
        return f"norms' share {100 * share:.1f}% is above 100% of the step"
    return ""


def ratio_problem(ratio: float, what: str) -> str:
    """Why a speed ratio between two ways of running the same norms cannot be true."""
    if ratio > MAX_RATIO or ratio < 1 / MAX_RATIO:
        return f"{what} {ratio:.4g}x is beyond {MAX_RATIO:g}x, more than any device does"
    return ""


def saving_problem(saving_ms: float, norm_ms: float, what: str) -> str:
    """Why a saving cannot be true: patching norms saves at most the time they took."""
    if norm_ms > 0 and saving_ms > SAVING_SLACK * norm_ms:
        return (f"{what} {saving_ms:.4f} ms is more than the norms' whole time "
                f"{norm_ms:.4f} ms in the step")
    return ""


def marked(text: str, problem: str) -> str:
    """The figure as printed: with the mark when it has a problem."""
    return text + MARK if problem else text

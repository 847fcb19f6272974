"""Barrier stalls: a multi-threaded op whose thread was descheduled.

An ATen op split over N threads ends at a barrier; when another process takes the core of one of
its threads, the others wait there until the scheduler gives that core back, a whole time slice
later. Such samples are not the op's speed: they sit far above the fastest sample, at multiples
of the scheduler's granularity (half a 4 ms slice at HZ=250). A single-threaded op has no
barrier, which is the remedy: `--threads 1`, or a quiet machine.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusionlab.records import TrialRecord

SLICE_MS = 4.0
"""The scheduler's time slice at HZ=250, the common kernel default."""
GRAIN_MS = SLICE_MS / 2
"""Stalls end on multiples of this (a slice, or half of one when the waiting thread yields)."""
STALL_FACTOR = 5.0
"""A stalled sample is at least this many times the fastest one, and a grain beyond it."""
MIN_STALLED = 3
MIN_SHARE = 0.25
"""A barrier stall: at least MIN_STALLED samples, and this share of all, stalled..."""
MIN_QUANTISED = 0.7
"""...and this share of the stalled ones within a quarter grain of a multiple of the grain."""


def is_barrier_stall(samples_ms: Sequence[float], calls_per_sample: int, threads: int) -> bool:
    """Whether a timing's samples (per call, `calls_per_sample` calls each) show a
    multi-threaded op stalled at its barrier: many samples far above the fastest, quantised at
    the scheduler's grain."""
    if threads < 2 or len(samples_ms) < MIN_STALLED:
        return False
    totals = [sample * calls_per_sample for sample in samples_ms]
    fastest = min(totals)
    stalled = [t for t in totals if t >= STALL_FACTOR * fastest and t - fastest >= GRAIN_MS]
    if len(stalled) < max(MIN_STALLED, MIN_SHARE * len(totals)):
        return False
    quantised = [t for t in stalled if abs(t / GRAIN_MS - round(t / GRAIN_MS)) <= 0.25]
    return len(quantised) >= MIN_QUANTISED * len(stalled)


def stall_line(labels: Sequence[str], threads: int) -> str:
    """One line naming the stalled configurations and the remedy."""
    return (
        f"barrier stall: {', '.join(labels)} ran {threads} threads and some samples waited "
        f"whole scheduler slices (multiples of {GRAIN_MS:g} ms) for a descheduled thread; those "
        "figures are the machine's, not the op's: sweep with --threads 1, or when the machine "
        "is quiet"
    )


def stalled(record: TrialRecord) -> bool:
    """Whether the record's warm or cold timing shows a barrier stall."""
    return any(
        timing is not None
        and is_barrier_stall(timing.samples_ms, timing.calls_per_sample, record.cell.threads)
        for timing in (record.timing, record.cold)
    )

"""Summary statistics of timing samples, computed in one place."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Median and spread of a list of samples (same unit as the samples)."""

    median: float
    q1: float
    q3: float
    minimum: float
    count: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def relative_iqr(self) -> float:
        """IQR as a fraction of the median: the noise figure shown next to latencies."""
        return self.iqr / self.median if self.median > 0 else 0.0


def summarise(samples: list[float]) -> Summary:
    """Median, quartiles and minimum of the samples."""
    if not samples:
        raise ValueError("no samples to summarise")
    ordered = sorted(samples)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return Summary(
        median=statistics.median(ordered), q1=q1, q3=q3, minimum=ordered[0], count=len(ordered)
    )


def coefficient_of_variation(samples: list[float]) -> float:
    """Standard deviation over mean; 0 for fewer than two samples."""
    if len(samples) < 2:
        return 0.0
    mean = statistics.fmean(samples)
    return statistics.stdev(samples) / mean if mean > 0 else 0.0


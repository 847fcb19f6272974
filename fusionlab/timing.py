"""The one timing loop every variant goes through."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fusionlab.records import Timing
from fusionlab.stats import coefficient_of_variation, summarise


@dataclass(frozen=True)
class TimingSettings:
    """How long to warm up and how many samples to take."""

    warmup_s: float = 0.05
    min_sample_s: float = 1e-3
    budget_s: float = 0.4
    min_samples: int = 10
    max_samples: int = 100


def time_calls(
    call: Callable[[], object],
    synchronize: Callable[[], None],
    first_call_ms: float,
    settings: TimingSettings,
) -> Timing:
    """Warm up, then take synchronised samples long enough for the clock's resolution."""
    estimate = _warm_up(call, synchronize, settings.warmup_s)
    calls_per_sample = max(1, math.ceil(settings.min_sample_s / estimate))
    sample_s = calls_per_sample * estimate
    count = int(min(settings.max_samples, max(settings.min_samples, settings.budget_s / sample_s)))
    samples_ms = []
    for _ in range(count):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            call()
        synchronize()
        samples_ms.append((time.perf_counter() - start) * 1e3 / calls_per_sample)
    summary = summarise(samples_ms)
    return Timing(
        first_call_ms=first_call_ms,
        median_ms=summary.median,
        q1_ms=summary.q1,
        q3_ms=summary.q3,
        min_ms=summary.minimum,
        cv=coefficient_of_variation(samples_ms),
        calls_per_sample=calls_per_sample,
        samples_ms=samples_ms,
    )


def _warm_up(call: Callable[[], object], synchronize: Callable[[], None], warmup_s: float) -> float:
    """Run the call for at least `warmup_s` (and 3 calls); return the per-call estimate in s."""
    calls = 0
    synchronize()
    start = time.perf_counter()
    while True:
        call()
        calls += 1
        synchronize()
        elapsed = time.perf_counter() - start
        if calls >= 3 and elapsed >= warmup_s:
            return max(elapsed / calls, 1e-9)


def timed_once(call: Callable[[], object], synchronize: Callable[[], None]) -> tuple[object, float]:
    """One synchronised call; returns its result and its duration in ms."""
    synchronize()
    start = time.perf_counter()
    result = call()
    synchronize()
    return result, (time.perf_counter() - start) * 1e3

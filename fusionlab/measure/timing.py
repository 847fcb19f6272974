"""The one timing loop every variant goes through.

Calls rotate over input sets; a few timed calls are kept whole so the gate checks what was
timed. On a device that can flush its cache (CUDA), cold samples flush before every call.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from fusionlab.measure.stats import coefficient_of_variation, summarise
from fusionlab.records import Timing

Call = Callable[[int], object]  # runs the kernel on input set `index`


@dataclass(frozen=True)
class TimingSettings:
    """How long to warm up and how many samples to take."""

    warmup_s: float = 0.03
    min_sample_s: float = 1e-3
    budget_s: float = 0.2
    min_samples: int = 10
    max_samples: int = 100
    checked_calls: int = 4  # timed calls whose outputs the gate checks, spread over the loop

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ValueError("timing needs a positive budget and 1 <= min_samples <= max_samples")


@dataclass
class TimedLoop:
    """A timing and the outputs kept from timed calls: (input set index, output)."""

    timing: Timing
    kept: list[tuple[int, object]]


def time_calls(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    settings: TimingSettings,
    before_kept: Callable[[int], None] | None = None,
    keep_copy: Callable[[object], object] | None = None,
    flush: Callable[[], None] | None = None,
    time_one: Callable[[Callable[[], object]], tuple[object, float]] | None = None,
    working_set_bytes: int = 0,
    seed: int = 0,
) -> TimedLoop:
    """Warm up, then take synchronised samples, each long enough for the clock's resolution.

    Call i of the loop uses input set i mod `sets`. `before_kept(index)` runs (untimed) before a
    sample with a kept call. The kept call sits at a seeded random offset in its sample, so a
    kernel cannot tell which calls are checked. With `keep_copy` (variants that write into their
    inputs) the kept call is its sample's first, its output is copied once the sample ends, and
    the rest of that sample leaves its input set alone. With `flush` (and the device's `time_one`
    clock), every sample is one call after a flush, as triton.testing.do_bench times.
    """
    estimate = _warm_up(call, sets, synchronize, settings.warmup_s)
    calls_per_sample = 1 if flush else max(1, math.ceil(settings.min_sample_s / estimate))
    sample_s = calls_per_sample * estimate
    count = int(min(settings.max_samples, max(settings.min_samples, settings.budget_s / sample_s)))
    keep_every = max(1, count // max(settings.checked_calls, 1))
    offsets = random.Random(seed)
    samples_ms: list[float] = []
    kept: list[tuple[int, object]] = []
    position = 0
    for sample in range(count):
        keep = settings.checked_calls > 0 and sample % keep_every == 0
        at = 0 if keep_copy else offsets.randrange(calls_per_sample)
        kept_set = (position + at) % sets
        if keep and before_kept is not None:
            before_kept(kept_set)
        if flush is not None and time_one is not None:
            flush()
            out, elapsed_ms = time_one(lambda index=kept_set: call(index))
            samples_ms.append(elapsed_ms)
            if keep:
                kept.append((kept_set, keep_copy(out) if keep_copy else out))
            position += 1
            continue
        synchronize()
        start = time.perf_counter()
        if keep:
            for offset in range(at):
                call((position + offset) % sets)
            kept_out = call(kept_set)
            for offset in range(at + 1, calls_per_sample):
                index = (position + offset) % sets
                call((index + 1) % sets if keep_copy and index == kept_set and sets > 1 else index)
        else:
            for offset in range(calls_per_sample):
                call((position + offset) % sets)
        synchronize()
        samples_ms.append((time.perf_counter() - start) * 1e3 / calls_per_sample)
        if keep:
            kept.append((kept_set, keep_copy(kept_out) if keep_copy else kept_out))
        position += calls_per_sample
    summary = summarise(samples_ms)
    timing = Timing(
        median_ms=summary.median,
        q1_ms=summary.q1,
        q3_ms=summary.q3,
        min_ms=summary.minimum,
        cv=coefficient_of_variation(samples_ms),
        calls_per_sample=calls_per_sample,
        samples_ms=samples_ms,
        input_sets=sets,
        working_set_bytes=working_set_bytes,
    )
    return TimedLoop(timing, kept)


def _warm_up(call: Call, sets: int, synchronize: Callable[[], None], warmup_s: float) -> float:
    """Run calls for at least `warmup_s` (and 3 calls); return the per-call estimate in s."""
    calls = 0
    synchronize()
    start = time.perf_counter()
    while True:
        call(calls % sets)
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

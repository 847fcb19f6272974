"""The one timing loop every variant goes through.

Calls rotate over input sets; some timed calls are kept whole so the gate checks what was timed.
On a device that can flush its cache (CUDA), cold samples flush before every call.

Variant code runs in this process, so nothing here trusts it: the clocks and the entropy source
(`os.urandom`) are bound when this module is imported (the worker imports it before any plugin),
and every loop verifies nothing the measuring path uses was replaced since (measure/integrity.py);
a second clock the variant does not see (the kernel's own accounting, `os.times`) watches every
loop, which calls are checked is drawn from the operating system's entropy after the calls
returned, and the process's CPU time must fit the cell's threads.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from os import times as _kernel_times
from os import urandom as _urandom
from time import perf_counter_ns as _clock_ns

from torch import get_num_threads as _torch_threads

from fusionlab.measure import events
from fusionlab.measure.integrity import replaced as _replaced
from fusionlab.measure.stats import coefficient_of_variation, summarise
from fusionlab.records import Timing

Call = Callable[[int], object]  # runs the kernel on input set `index`

CLOCK_TOLERANCE_S = 0.05
"""Slack of the clock cross-check: os.times() ticks in 10 ms steps on Linux (CLK_TCK = 100)."""

THREAD_SLACK = 0.5
"""CPU seconds per wall second a timing loop may use beyond the cell's thread count (the
interpreter's own bookkeeping); more means the variant ran on threads the cell does not have."""

CLOCK_RATIO = 1.5
"""A loop the kernel saw take more than this many times what the bound clock measured is
suspicious: the two clocks read the same interval, so only a replaced clock drifts apart."""


_TIME_CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time",
                "time_ns", "process_time", "process_time_ns", "thread_time", "thread_time_ns")
_ORIGINAL = {name: getattr(time, name) for name in _TIME_CLOCKS}
_BOUND = {"_clock_ns": _clock_ns, "_kernel_times": _kernel_times, "_urandom": _urandom,
          "_replaced": _replaced, "_torch_threads": _torch_threads}


def clock_tampering() -> str | None:
    """Which clock, entropy source or other part of the measuring path something in this process
    replaced since this module was imported, or None: a variant that replaces one tried to
    change its own timing or learn which calls are checked (it never can, here)."""
    for name, original in _ORIGINAL.items():
        if getattr(time, name) is not original:
            return f"time.{name} was replaced in the measuring process"
    here = vars(sys.modules[__name__])
    for name, original in _BOUND.items():
        if here.get(name) is not original:
            return f"the measuring clock or entropy source {__name__}.{name} was replaced"
    name = _replaced()
    if name is not None:
        return f"{name} was replaced in the measuring process"
    return None


def now_s() -> float:
    """The measuring clock (bound at import), in seconds."""
    return _clock_ns() * 1e-9


def draw(count: int) -> int:
    """An index in range(count) from the operating system's entropy, read through `os.urandom`
    as bound at import (no state in this process a variant could copy or steer); rejection
    sampling keeps every index equally likely."""
    if count <= 0:
        raise ValueError(f"draw from range({count}): must be positive")
    span = 1 << 64
    limit = span - span % count
    while True:
        value = int.from_bytes(_urandom(8), "little")
        if value < limit:
            return value % count


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
    """A timing, the outputs kept from timed calls: (input set index, output), the loop's
    wall time by the measuring clock and by the kernel's clock (`os.times`), the CPU time the
    process used meanwhile, the cell's thread count (0: not checked), the samples after which
    torch's thread count was not the cell's, and what the audit hook saw (measure/events.py)."""

    timing: Timing
    kept: list[tuple[int, object]]
    clock_s: float = 0.0
    kernel_s: float = 0.0
    cpu_s: float = 0.0
    threads: int = 0
    thread_changes: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    def reason(self) -> str | None:
        """Why the loop cannot be trusted (clocks, what the variant did, its threads), or None."""
        return self.clock_reason() or self.events_reason() or self.threads_reason()

    def events_reason(self) -> str | None:
        """What the variant did while measured that the gate cannot account for, or None."""
        seen = self.events or ([events.tampered()] if events.tampered() else [])
        if not seen:
            return None
        named = ", ".join(dict.fromkeys(seen))
        return (f"while it was measured the variant did what the gate cannot account for: "
                f"{named[:300]}")

    def threads_reason(self) -> str | None:
        """Whether the loop ran on more threads than the cell has, or None."""
        if not self.threads:
            return None
        if self.thread_changes:
            return (f"torch's thread count was not the cell's {self.threads} after sample(s) "
                    f"{self.thread_changes[:5]}: the variant changed it")
        allowed = (self.threads + THREAD_SLACK) * self.clock_s + CLOCK_TOLERANCE_S
        if self.cpu_s <= allowed:
            return None
        return (f"the timing loop used {self.cpu_s:.3g} s of CPU time in {self.clock_s:.3g} s, "
                f"{self.cpu_s / self.clock_s:.2g} cores busy for a cell of {self.threads} "
                f"thread(s) (flagged above {self.threads + THREAD_SLACK:g}): the variant ran on "
                "threads the cell does not have")

    def clock_reason(self) -> str | None:
        """Why the loop's clock cannot be trusted, or None."""
        tampered = clock_tampering()
        if tampered:
            return f"{tampered}: a variant may not touch the clocks that time it"
        if self.kernel_s <= CLOCK_RATIO * self.clock_s + CLOCK_TOLERANCE_S:
            return None
        return (f"the timing loop took {self.kernel_s:.3g} s by the kernel's clock but "
                f"{self.clock_s:.3g} s by the measuring clock (flagged above {CLOCK_RATIO:g}x): "
                "the clock was replaced or stopped while the variant ran")


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
    threads: int = 0,
) -> TimedLoop:
    """Warm up, then take synchronised samples, each long enough for the clock's resolution.

    Call i of the loop uses input set i mod `sets`. Every call of a sample is made the same way
    and its output held until the sample's calls have all returned; only then is it drawn (from
    os.urandom) whether the sample is checked and which of its calls, so neither the stack nor
    the arguments tell a call whether it will be checked. With `keep_copy` (variants that
    write into their inputs) the kept call is a checked sample's first, drawn before it (its
    reference must be taken before the call, `before_kept(index)`, untimed), its output is
    copied once the sample ends, and the rest of that sample leaves its input set alone. With
    `flush` (and the device's `time_one` clock), every sample is one call after a flush, as
    triton.testing.do_bench times. With `threads` (the cell's thread count), torch's thread
    count is read after every sample and the loop's CPU time is kept for the threads rule. The
    whole loop runs under the audit hook's watch (measure/events.py).
    """
    with events.watching() as seen:
        loop = _loop(call, sets, synchronize, settings, before_kept, keep_copy, flush, time_one,
                     working_set_bytes, threads)
    loop.events = seen
    return loop


def _loop(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    settings: TimingSettings,
    before_kept: Callable[[int], None] | None,
    keep_copy: Callable[[object], object] | None,
    flush: Callable[[], None] | None,
    time_one: Callable[[Callable[[], object]], tuple[object, float]] | None,
    working_set_bytes: int,
    threads: int,
) -> TimedLoop:
    """time_calls' loop; see there."""
    kernel_start, clock_start = _kernel_times(), _clock_ns()
    thread_changes: list[int] = []
    estimate = _warm_up(call, sets, synchronize, settings.warmup_s)
    calls_per_sample = 1 if flush else max(1, math.ceil(settings.min_sample_s / estimate))
    sample_s = calls_per_sample * estimate
    count = int(min(settings.max_samples, max(settings.min_samples, settings.budget_s / sample_s)))
    checked = min(settings.checked_calls, count)
    samples_ms: list[float] = []
    kept: list[tuple[int, object]] = []
    outputs: list[object] = [None] * calls_per_sample
    position = 0
    for number in range(count + 1):
        if threads and _torch_threads() != threads:  # after warm-up and after every sample
            thread_changes.append(number)
        if number == count:
            break
        if flush is not None and time_one is not None:
            index = position % sets
            keep = keep_copy is not None and _drawn(count, checked)
            if keep and before_kept is not None:
                before_kept(index)
            flush()
            out, elapsed_ms = time_one(lambda index=index: call(index))
            samples_ms.append(elapsed_ms)
            if keep_copy is None:
                keep = _drawn(count, checked)
            if keep:
                kept.append((index, keep_copy(out) if keep_copy else out))
            position += 1
            continue
        if keep_copy is not None:
            keep = _drawn(count, checked)
            samples_ms.append(_inplace_sample(call, sets, synchronize, position, calls_per_sample,
                                              keep, before_kept, keep_copy, kept))
            position += calls_per_sample
            continue
        synchronize()
        start = _clock_ns()
        for offset in range(calls_per_sample):
            outputs[offset] = call((position + offset) % sets)
        if _drawn(count, checked):
            at = draw(calls_per_sample)
            kept.append(((position + at) % sets, outputs[at]))
        outputs[:] = [None] * calls_per_sample
        synchronize()
        samples_ms.append((_clock_ns() - start) * 1e-6 / calls_per_sample)
        position += calls_per_sample
    timing = _timing(samples_ms, calls_per_sample, sets, working_set_bytes)
    clock_s = (_clock_ns() - clock_start) * 1e-9
    end = _kernel_times()
    cpu_s = end.user + end.system - kernel_start.user - kernel_start.system
    return TimedLoop(timing, kept, clock_s, end.elapsed - kernel_start.elapsed, cpu_s, threads,
                     thread_changes)


def _drawn(count: int, checked: int) -> bool:
    """Whether a sample is checked: each of `count` samples independently with the chance
    checked / count, from os.urandom, so what was checked so far says nothing of what will be."""
    return draw(count) < checked


def _inplace_sample(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    position: int,
    calls_per_sample: int,
    keep: bool,
    before_kept: Callable[[int], None] | None,
    keep_copy: Callable[[object], object],
    kept: list[tuple[int, object]],
) -> float:
    """One sample of a variant that writes into its inputs; returns ms per call."""
    kept_set = position % sets
    if keep and before_kept is not None:
        before_kept(kept_set)
    synchronize()
    start = _clock_ns()
    kept_out = call(kept_set)
    for offset in range(1, calls_per_sample):
        index = (position + offset) % sets
        call((index + 1) % sets if keep and index == kept_set and sets > 1 else index)
    synchronize()
    elapsed_ms = (_clock_ns() - start) * 1e-6 / calls_per_sample
    if keep:
        kept.append((kept_set, keep_copy(kept_out)))
    return elapsed_ms


def _timing(samples_ms: list[float], calls_per_sample: int, sets: int, nbytes: int) -> Timing:
    summary = summarise(samples_ms)
    return Timing(
        median_ms=summary.median,
        q1_ms=summary.q1,
        q3_ms=summary.q3,
        min_ms=summary.minimum,
        cv=coefficient_of_variation(samples_ms),
        calls_per_sample=calls_per_sample,
        samples_ms=samples_ms,
        input_sets=sets,
        working_set_bytes=nbytes,
    )


def _warm_up(call: Call, sets: int, synchronize: Callable[[], None], warmup_s: float) -> float:
    """Run calls for at least `warmup_s` (and 3 calls); return the per-call estimate in s."""
    calls = 0
    synchronize()
    start = now_s()
    while True:
        call(calls % sets)
        calls += 1
        synchronize()
        elapsed = now_s() - start
        if calls >= 3 and elapsed >= warmup_s:
            return max(elapsed / calls, 1e-9)


def timed_once(call: Callable[[], object], synchronize: Callable[[], None]) -> tuple[object, float]:
    """One synchronised call; returns its result and its duration in ms."""
    synchronize()
    start = _clock_ns()
    result = call()
    synchronize()
    return result, (_clock_ns() - start) * 1e-6

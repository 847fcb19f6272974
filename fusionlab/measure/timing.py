"""The one timing loop every variant goes through.

Calls rotate over input sets; some timed calls are kept whole so the gate checks what was timed.
On a device that can flush its cache (CUDA), cold samples flush before every call.

Variant code runs in this process, so nothing here trusts it: the clocks and the entropy source
(`os.urandom`) are bound when this module is imported (the worker imports it before any plugin),
and every loop verifies nothing the measuring path uses was replaced since (measure/integrity.py);
a second clock the variant does not see (the kernel's own accounting, `os.times`) watches every
loop, which calls are checked is drawn from the operating system's entropy after the calls
returned, and the process's CPU time must fit the cell's threads.

Every sample looks alike to the variant: the same calls and the same harness work between them,
whether it is checked or not; which sample is checked, and which of its calls, is drawn after it
ended. The untimed gaps between timed windows are accounted for: this thread's CPU time in them
must match the harness's own measured cost of that work (a variant's code run there, through a
finalizer or a hook, is work hidden from the timer).
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
from time import thread_time_ns as _thread_cpu_ns
from typing import Protocol

from torch import get_num_threads as _torch_threads

from fusionlab.measure import events, rules
from fusionlab.measure.integrity import dispatcher_changed as _dispatcher_changed
from fusionlab.measure.integrity import replaced as _replaced
from fusionlab.measure.stats import coefficient_of_variation, summarise
from fusionlab.records import Timing

Call = Callable[[int], object]  # runs the kernel on input set `index`

CLOCK_TOLERANCE_S = 0.05
"""Slack of the clock cross-check: os.times() ticks in 10 ms steps on Linux (CLK_TCK = 100)."""

THREAD_SLACK = 0.5
"""CPU seconds per wall second a timing loop may use beyond the cell's thread count (the
interpreter's own bookkeeping); more means the variant ran on threads the cell does not have."""

GAP_FACTOR = 4.0
"""The CPU time this thread spends in a loop's untimed gaps may reach this many times the harness's
own measured cost of the work it does there ..."""

GAP_SHARE = 0.25
"""... plus this share of the CPU time it spent in the timed windows (an honest variant's outputs
freed after a sample, cache effects) plus GAP_SLACK_S; more is work hidden from the timer."""

GAP_SLACK_S = 0.005

_CALIBRATIONS = 5
"""Runs of the harness's own gap work, on its own objects, whose median is its measured cost."""

CLOCK_RATIO = 1.5
"""A loop the kernel saw take more than this many times what the bound clock measured is
suspicious: the two clocks read the same interval, so only a replaced clock drifts apart."""


_TIME_CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time",
                "time_ns", "process_time", "process_time_ns", "thread_time", "thread_time_ns")
_ORIGINAL = {name: getattr(time, name) for name in _TIME_CLOCKS}
_BOUND = {"_clock_ns": _clock_ns, "_kernel_times": _kernel_times, "_urandom": _urandom,
          "_replaced": _replaced, "_torch_threads": _torch_threads,
          "_thread_cpu_ns": _thread_cpu_ns, "_dispatcher_changed": _dispatcher_changed}


def clock_tampering() -> str | None:
    """Which clock, entropy source or other part of the measuring path something in this process
    replaced since this module was imported, or None: a variant that replaces one tried to
    change its own timing or learn which calls are checked (it never can, here)."""
    if rules.on("replaced_clocks"):
        for name, original in _ORIGINAL.items():
            if getattr(time, name) is not original:
                return f"time.{name} was replaced in the measuring process"
        here = vars(sys.modules[__name__])
        for name, original in _BOUND.items():
            if here.get(name) is not original:
                return f"the measuring clock or entropy source {__name__}.{name} was replaced"
    name = _replaced() if rules.on("nothing_replaced") else None
    if name is not None:
        return f"{name} was replaced in the measuring process"
    return None


def dispatcher_tampering() -> str | None:
    """Why the dispatcher can no longer be trusted in this process (an ATen op's kernel table
    changed since the seal, measure/integrity.py), or None."""
    op = _dispatcher_changed()
    if op is None:
        return None
    return (f"sealed dispatcher table: the kernel table of {op} changed in the measuring process "
            "(a kernel registered over it): the gate's checks, the references and the built-in "
            "run on it")


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
    """A timing, the outputs kept from timed calls: (input set index, output), for a variant that
    writes into its inputs the copy of each kept call's inputs taken before it (`kept_inputs`), the
    loop's wall time by the measuring clock and by the kernel's clock (`os.times`), the CPU time
    the process used meanwhile, the cell's thread count (0: not checked), the samples after which
    torch's thread count was not the cell's, what the audit hook saw (measure/events.py), and the
    untimed gaps between timed windows (`gaps`), and the refill probe's call (`probed`: its
    output; `altered_kept`: the numbers of kept calls made on the probe's changed values)."""

    timing: Timing
    kept: list[tuple[int, object]]
    clock_s: float = 0.0
    kernel_s: float = 0.0
    cpu_s: float = 0.0
    threads: int = 0
    thread_changes: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    kept_inputs: list[object] = field(default_factory=list)
    gaps: Gaps | None = None
    probed: object = None
    altered_kept: list[int] = field(default_factory=list)

    def reason(self) -> str | None:
        """Why the loop cannot be trusted (clocks, what the variant did, its threads, work in the
        untimed gaps), or None."""
        return (self.clock_reason() or dispatcher_tampering() or self.events_reason()
                or self.threads_reason() or (self.gaps.reason() if self.gaps else None))

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
        if self.cpu_s <= allowed or not rules.on("cpu_time"):
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


@dataclass
class Gaps:
    """A loop's timed windows and the untimed gaps between them: this thread's CPU time in each
    (a descheduled thread uses none, so another process's load does not count), their wall
    times (for benchmarks/gap_cost.py), and the harness's own CPU cost of one gap, measured."""

    window_cpu_ns: int = 0
    gap_cpu_ns: int = 0
    walls_ns: list[int] = field(default_factory=list)
    windows_ns: list[int] = field(default_factory=list)
    harness_cpu_ns: float = 0.0
    copies_cpu_ns: int = 0  # the harness's copies in the gaps (in place), measured as made, freed
    copying_ns: int = 0  # copies made since the last window closed (a gap once the next opens)
    _closed: tuple[int, int] | None = None  # the last window's end: (clock, thread CPU)
    _opened_cpu: int = 0
    _opened_clock: int = 0

    def open(self) -> int:
        """Start a timed window; returns the measuring clock's reading."""
        cpu = _thread_cpu_ns()
        start = _clock_ns()
        if self._closed is not None:
            self.walls_ns.append(start - self._closed[0])
            self.gap_cpu_ns += cpu - self._closed[1]
            self.copies_cpu_ns += self.copying_ns
        self.copying_ns = 0
        self._opened_cpu, self._opened_clock = cpu, start
        return start

    def close(self) -> int:
        """End the timed window; returns the measuring clock's reading."""
        end = _clock_ns()
        cpu = _thread_cpu_ns()
        self.window_cpu_ns += cpu - self._opened_cpu
        self.windows_ns.append(end - self._opened_clock)
        self._closed = (end, cpu)
        return end

    def closed_cpu_ns(self) -> int:
        """This thread's CPU clock as the last window closed."""
        return self._closed[1] if self._closed is not None else _thread_cpu_ns()

    def reason(self) -> str | None:
        """Whether this thread's CPU time in the gaps, less the harness's in-place copies, went
        beyond the harness's own measured cost there (GAP_FACTOR, GAP_SHARE), or None."""
        count = len(self.walls_ns)
        if not count:
            return None
        harness_s = count * self.harness_cpu_ns * 1e-9
        allowed = GAP_FACTOR * harness_s + GAP_SHARE * self.window_cpu_ns * 1e-9 + GAP_SLACK_S
        spent = (self.gap_cpu_ns - self.copies_cpu_ns) * 1e-9
        if spent <= allowed or not rules.on("untimed_gaps"):
            return None
        return (f"untimed gaps: {spent:.3g} s of CPU time ran in the {count} gaps between "
                f"timed calls, where the harness's own work there measured {harness_s:.3g} s "
                f"(flagged above {allowed:.3g} s): the variant worked outside the timed windows")


class Alteration(Protocol):
    """The refill probe (measure/probe.py): changes a value of an input set, and restores it."""

    def alter(self, index: int) -> None: ...

    def restore(self) -> None: ...


def _median(values: list[int]) -> float:
    return float(sorted(values)[len(values) // 2])


def time_calls(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    settings: TimingSettings,
    snapshot: Callable[[int], object] | None = None,
    keep_copy: Callable[[object], object] | None = None,
    flush: Callable[[], None] | None = None,
    time_one: Callable[[Callable[[], object]], tuple[object, float]] | None = None,
    working_set_bytes: int = 0,
    threads: int = 0,
    probe: Alteration | None = None,
) -> TimedLoop:
    """Warm up, then take synchronised samples, each long enough for the clock's resolution.

    Call i of the loop uses input set i mod `sets`. Every call of a sample is made the same way
    and its output held until the sample's calls have all returned; only then is it drawn (from
    os.urandom) whether the sample is checked and which of its calls, and both draws are made
    for every sample, so neither the stack, the arguments, the pauses nor
    the harness's work tell a call whether it will be checked. With `snapshot` and `keep_copy`
    (variants that write into their inputs) every call is its own timed window, and after each
    the harness copies its outputs (`keep_copy`) and its input set's new values (`snapshot(i)`:
    the next call on that set's inputs), untimed, checked or not; a kept call comes with the copy
    of its inputs taken before it (`TimedLoop.kept_inputs`). With `flush` (and the device's
    `time_one` clock), every sample is one call after a flush, as triton.testing.do_bench times.
    With `threads` (the cell's thread count), torch's thread count is read after every sample
    and the loop's CPU time is kept for the threads rule. The untimed gaps between windows are
    measured against the harness's own measured cost of them (`Gaps`, not on the flush path,
    whose device clock times the calls). With `probe` (not in place, not flushed), after a
    sample drawn at the start (a local no variant reaches) an input value of the next sample's
    set is changed, untimed, that sample's first call kept (`TimedLoop.probed`), and the value
    restored after it. The whole loop runs under the audit hook's watch (measure/events.py).
    """
    with events.watching() as seen:
        loop = _loop(call, sets, synchronize, settings, snapshot, keep_copy, flush, time_one,
                     working_set_bytes, threads, probe)
    loop.events = seen
    return loop


@dataclass
class _Plan:
    """What a loop's samples are: how many, of how many calls each, how many checked."""

    count: int
    calls_per_sample: int
    checked: int


def _loop(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    settings: TimingSettings,
    snapshot: Callable[[int], object] | None,
    keep_copy: Callable[[object], object] | None,
    flush: Callable[[], None] | None,
    time_one: Callable[[Callable[[], object]], tuple[object, float]] | None,
    working_set_bytes: int,
    threads: int,
    probe: Alteration | None,
) -> TimedLoop:
    """time_calls' loop; see there."""
    kernel_start, clock_start = _kernel_times(), _clock_ns()
    estimate = _warm_up(call, sets, synchronize, settings.warmup_s)
    calls_per_sample = 1 if flush else max(1, math.ceil(settings.min_sample_s / estimate))
    inplace = snapshot is not None and keep_copy is not None
    # Each set's values before its next call (a variant that writes into its inputs), and what
    # copying after a call costs: the loop keeps to its budget with those copies in it.
    copy_start = _clock_ns()
    states = [snapshot(index) for index in range(sets)] if inplace else []  # type: ignore[misc]
    per_call = estimate + (2 * (_clock_ns() - copy_start) * 1e-9 / sets if inplace else 0.0)
    count = int(min(settings.max_samples,
                    max(settings.min_samples, settings.budget_s / (calls_per_sample * per_call))))
    plan = _Plan(count, calls_per_sample, min(settings.checked_calls, count))
    gaps = None if flush else Gaps()
    if gaps is not None:
        gaps.harness_cpu_ns = _harness_gap_cost(calls_per_sample if inplace else 1)
    loop = TimedLoop(_timing([0.0], 1, sets, 0), [], threads=threads, gaps=gaps)
    if not (probe is not None and not inplace and flush is None and count > 1
            and rules.on("refill_probe")):
        probe = None
    samples_ms = _samples(call, sets, synchronize, plan, snapshot, keep_copy, flush, time_one,
                          states, loop, probe)
    loop.timing = _timing(samples_ms, calls_per_sample, sets, working_set_bytes)
    loop.clock_s = (_clock_ns() - clock_start) * 1e-9
    end = _kernel_times()
    loop.kernel_s = end.elapsed - kernel_start.elapsed
    loop.cpu_s = end.user + end.system - kernel_start.user - kernel_start.system
    return loop


def _samples(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    plan: _Plan,
    snapshot: Callable[[int], object] | None,
    keep_copy: Callable[[object], object] | None,
    flush: Callable[[], None] | None,
    time_one: Callable[[Callable[[], object]], tuple[object, float]] | None,
    states: list[object],
    loop: TimedLoop,
    probe: Alteration | None,
) -> list[float]:
    """The loop's samples, ms per call each: torch's thread count read after the warm-up and
    after every sample (into `loop.thread_changes`), and with `probe`, after a sample drawn at
    the start, the next sample's set changed untimed and restored after that sample."""
    watch_threads = loop.threads and rules.on("thread_count")
    probed_after = draw(plan.count - 1) if probe is not None else -2
    samples_ms: list[float] = []
    position = 0
    for number in range(plan.count + 1):
        if watch_threads and _torch_threads() != loop.threads:
            loop.thread_changes.append(number)
        if number == plan.count:
            break
        if flush is not None and time_one is not None:
            samples_ms.append(_flushed_sample(call, position % sets, flush, time_one, plan,
                                              snapshot, keep_copy, states, loop))
        elif snapshot is not None and keep_copy is not None:
            samples_ms.append(_inplace_sample(call, sets, synchronize, position, plan,
                                              snapshot, keep_copy, states, loop))
        else:
            samples_ms.append(_sample(call, sets, synchronize, position, plan, loop,
                                      number == probed_after + 1))
        position += plan.calls_per_sample
        if probe is not None and number == probed_after:
            probe.alter(position % sets)  # untimed, after the fact: the next sample's set
        elif probe is not None and number == probed_after + 1:
            probe.restore()
    return samples_ms


def _drawn(count: int, checked: int) -> bool:
    """Whether a sample is checked: each of `count` samples independently with the chance
    checked / count, from os.urandom, so what was checked so far says nothing of what will be."""
    return draw(count) < checked


def _sample(call: Call, sets: int, synchronize: Callable[[], None], position: int, plan: _Plan,
            loop: TimedLoop, probed: bool = False) -> float:
    """One sample of calls in one timed window; returns ms per call. Whether it is checked, and
    which call, is drawn once all its calls returned (both draws for every sample); the outputs
    not kept are let go inside the window (what freeing them runs is timed). `probed`: the
    sample after the refill probe changed its first set: its first call is kept as the probe's,
    and a checked call on that set is marked as made on the changed values."""
    gaps: Gaps = loop.gaps  # type: ignore[assignment]
    outputs: list[object] = [None] * plan.calls_per_sample
    synchronize()
    start = gaps.open()
    for offset in range(plan.calls_per_sample):
        outputs[offset] = call((position + offset) % sets)
    checked, at = _drawn(plan.count, plan.checked), draw(plan.calls_per_sample)
    if checked:
        if probed and (position + at) % sets == position % sets:
            loop.altered_kept.append(len(loop.kept))
        loop.kept.append(((position + at) % sets, outputs[at]))
    if probed:
        loop.probed = outputs[0]
    outputs.clear()
    synchronize()
    return (gaps.close() - start) * 1e-6 / plan.calls_per_sample


def _inplace_sample(
    call: Call,
    sets: int,
    synchronize: Callable[[], None],
    position: int,
    plan: _Plan,
    snapshot: Callable[[int], object],
    keep_copy: Callable[[object], object],
    states: list[object],
    loop: TimedLoop,
) -> float:
    """One sample of a variant that writes into its inputs: each call in its own window, then,
    untimed and for every call alike, copies of its outputs and of its set's new values; which
    call (if any) is checked is drawn after the sample. Returns ms per call."""
    gaps: Gaps = loop.gaps  # type: ignore[assignment]
    made: list[tuple[int, object, object]] = []  # (set, its values before the call, outputs)
    elapsed_ns = 0
    for offset in range(plan.calls_per_sample):
        index = (position + offset) % sets
        synchronize()
        start = gaps.open()
        out = call(index)
        synchronize()
        elapsed_ns += gaps.close() - start
        copying = gaps.closed_cpu_ns()  # this thread's CPU clock as the window closed
        made.append((index, states[index], keep_copy(out)))
        states[index] = snapshot(index)
        gaps.copying_ns += _thread_cpu_ns() - copying
        del out
    checked, at = _drawn(plan.count, plan.checked), draw(plan.calls_per_sample)
    if checked:
        index, before, outputs = made[at if rules.on("samples_alike") else 0]
        loop.kept.append((index, outputs))
        loop.kept_inputs.append(before)
    releasing = _thread_cpu_ns()
    made.clear()  # the copies: freeing large ones takes the kernel a while
    gaps.copying_ns += _thread_cpu_ns() - releasing
    return elapsed_ns * 1e-6 / plan.calls_per_sample


def _flushed_sample(
    call: Call,
    index: int,
    flush: Callable[[], None],
    time_one: Callable[[Callable[[], object]], tuple[object, float]],
    plan: _Plan,
    snapshot: Callable[[int], object] | None,
    keep_copy: Callable[[object], object] | None,
    states: list[object],
    loop: TimedLoop,
) -> float:
    """One call after a cache flush, timed by the device's clock; returns its ms. For a variant
    that writes into its inputs, its outputs and its set's new values are copied after it."""
    flush()
    out, elapsed_ms = time_one(lambda: call(index))
    before = None
    if snapshot is not None and keep_copy is not None:
        before, out = states[index], keep_copy(out)
        states[index] = snapshot(index)
    checked, _ = _drawn(plan.count, plan.checked), draw(plan.calls_per_sample)
    if checked:
        loop.kept.append((index, out))
        if before is not None:
            loop.kept_inputs.append(before)
    return elapsed_ms


def _harness_gap_cost(calls: int) -> float:
    """The harness's own work in one untimed gap, run with no variant code: this thread's CPU
    ns, the median of _CALIBRATIONS runs. That work: the clocks read at a window's edges,
    and after a sample of `calls` windows the two draws and torch's thread count (per window).
    The copies a variant that writes into its inputs gets after each call are not in it: the
    loop measures those as it makes them (`Gaps.copies_cpu_ns`)."""
    cpu: list[int] = []
    for _ in range(_CALIBRATIONS):
        cpu_start = _thread_cpu_ns()
        for _ in range(calls):
            _clock_ns()
            _thread_cpu_ns()
            _thread_cpu_ns()
            _clock_ns()
        draw(2)
        draw(2)
        _torch_threads()
        cpu.append((_thread_cpu_ns() - cpu_start) // calls)
    return _median(cpu)


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

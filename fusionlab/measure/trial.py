"""One trial: build a variant, gate what it returns (timed calls included), time it warm and
cold, and profile it. Runs in the worker process; failures become statuses, never exceptions."""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionlab.cell import Cell
from fusionlab.devices import Device, get_device
from fusionlab.kernels import cpp_build
from fusionlab.measure import disturbance, quiet_limits, rules
from fusionlab.measure.correctness import (
    GateFailure,
    check_memory,
    check_mutation,
    check_not_retained,
    check_values,
    refill_in_place,
    snapshot,
)
from fusionlab.measure.inputs import WARM_SETS, InputCache, InputSets, tensors_in
from fusionlab.measure.limits import LimitsCache, measure_copy_limits, suspicious_reason
from fusionlab.measure.pass_memory import pass_memory
from fusionlab.measure.passes import PassCall, as_pass, pass_spec, unsupported_reason
from fusionlab.measure.probe import ChangedReference, Probe
from fusionlab.measure.profiling import (
    ProfilerSettings,
    export_trace,
    fusion_accounting,
    key_averages_table,
    operator_input_elements,
    profile_calls,
)
from fusionlab.measure.screen import Screen
from fusionlab.measure.timing import (
    TimedLoop,
    TimingSettings,
    dispatcher_tampering,
    draw,
    now_s,
    time_calls,
    timed_once,
)
from fusionlab.op import OpSpec, Tolerance
from fusionlab.records import Accuracy, CopyLimits, Fusion, Status, Timing, TrialRecord
from fusionlab.registry import Kernel, Variant, get_op, get_variant
from fusionlab.shapes import format_shape, torch_dtype

_REMEASURES = 3
DISTURBED_RETRIES = 2
"""A trial's timing that other processes disturbed is measured again up to this many times."""
_INPUTS = InputCache()
_LIMITS = LimitsCache()


@dataclass(frozen=True)
class TrialTask:
    """Everything a worker needs to measure one configuration."""

    cell: Cell
    variant: str
    params: dict[str, Any]
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    profiler: ProfilerSettings = field(default_factory=ProfilerSettings)
    profile_table_rows: int = 0
    trace_dir: str | None = None
    screen: Screen | None = None  # screen: measured in full only when a brief timing passes

    def new_record(self, status: Status, message: str = "") -> TrialRecord:
        """A record for this task with no measurement in it yet."""
        return TrialRecord(
            cell=self.cell,
            variant=self.variant,
            params=dict(self.params),
            status=status,
            message=message,
            seed=self.seed,
        )

    def run(self) -> dict[str, Any]:
        return run_trial(self).to_dict()

    def failed(self, status: Status, message: str) -> dict[str, Any]:
        return self.new_record(status, message).to_dict()


def describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return " | ".join(line.strip() for line in text.splitlines()[:3] if line.strip())[:500]


_COMPILE_COUNTERS = ("fxgraph_cache_miss", "fxgraph_cache_hit")


def _compile_counts() -> dict[str, int]:
    """Inductor's graph-cache counters in this process so far (none before dynamo is used)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    return {name: int(counters["inductor"][name]) for name in _COMPILE_COUNTERS}


def _is_compile_error(error: BaseException) -> bool:
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.utils.cpp_extension"))


def run_trial(task: TrialTask) -> TrialRecord:
    """Measure one configuration; failures become statuses, never exceptions."""
    start = now_s()
    record = task.new_record(Status.PASSED)
    compiles_before = _compile_counts()
    try:
        _measure(task, record)
    except GateFailure as failure:
        record.status, record.message = failure.status, str(failure)
    except Exception as error:
        record.status, record.message = Status.RUNTIME_ERROR, describe(error)
        traceback.print_exc(file=sys.stderr)
    tampered = dispatcher_tampering() if record.passed else None
    if tampered:  # after the loops (the refill, the profiler pass): the worker retires
        record.status, record.message = Status.SUSPICIOUS, tampered
    after = _compile_counts()
    record.compiles = {k: after.get(k, 0) - compiles_before.get(k, 0) for k in _COMPILE_COUNTERS}
    if not record.passed:
        _INPUTS.drop()  # the sets may have been written to; the next trial makes new ones
    record.trial_s = now_s() - start
    return record


@dataclass
class Measured:
    """What building and gating a kernel gives the timing passes."""

    spec: OpSpec
    variant: Variant
    device: Device
    sets: InputSets
    kernel: Kernel | PassCall  # a PassCall for the backward passes (measure/passes.py)
    tolerance: Tolerance | tuple[Tolerance, ...]  # one per output for the backward passes
    like: torch.Tensor
    threads: int  # torch's thread count before the variant was built: the cell's
    # C++ extension builds its setup paid (kernels/cpp_build.py), in seconds: not in setup_ms.
    builds_s: dict[str, float] = field(default_factory=dict)

    @property
    def memory_rules(self) -> bool:
        """Whether the outputs must be fresh memory the variant no longer holds: a forward
        that writes no input. Gradients may share memory with each other and with an upstream
        gradient (autograd hands one tensor to both inputs of an add), so their gate is values
        on drawn timed calls and after their inputs changed in place."""
        return not self.variant.inplace and not isinstance(self.kernel, PassCall)

    def prepare(self, count: int) -> None:
        """Before timing the first `count` sets: a backward pass runs and keeps their forwards."""
        if isinstance(self.kernel, PassCall):
            self.kernel.prepare(self.sets.sets[:count])

    def forget_saved(self) -> None:
        """After input values changed in place: a backward pass's kept forwards are stale."""
        if isinstance(self.kernel, PassCall):
            self.kernel.forget()


def build_and_gate(
    cell: Cell, name: str, params: dict[str, Any], seed: int, reset: bool = True
) -> tuple[Measured, float, float, Accuracy]:
    """Build the kernel, make its first call and gate it; returns setup and first-call ms.
    A backward pass (cell.pass_name) measures the pass's op and the kernel run as that pass."""
    op, variant, device = get_op(cell.op), get_variant(cell.op, name), get_device(cell.device)
    unsupported = unsupported_reason(variant, cell.pass_name)
    if unsupported:
        raise GateFailure(Status.UNSUPPORTED, unsupported)
    if reset and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # every variant pays its own compile time in its first call
    dtype = torch_dtype(cell.dtype)
    spec = pass_spec(op, cell.pass_name, cell.shape, dtype)
    # An in-place variant writes to its inputs: it gets sets of its own, so the shared ones
    # stay as generated for every other variant (in a trial and in interleaved rounds).
    where = device.torch_device
    if variant.inplace:
        sets = InputSets(spec, cell.shape, dtype, where, seed)
    else:
        sets = _INPUTS.get(spec, cell.shape, dtype, where, seed)
    sets.ensure(WARM_SETS)
    first = sets.sets[0]
    like = tensors_in(first)[0]
    references = sets.reference(0)  # before the call: an in-place variant overwrites its inputs
    originals = snapshot(first)
    threads = torch.get_num_threads()
    paid_before = cpp_build.builds_paid()
    try:
        kernel, setup_ms = timed_once(
            lambda: as_pass(variant.factory(device.type, **params), op, cell.pass_name),
            device.synchronize,
        )
    except Exception as error:
        raise GateFailure(Status.COMPILE_ERROR, f"setup failed: {describe(error)}") from error
    # An extension build is paid once for every cell after it: it is no cell's first use.
    builds = {name: seconds for name, seconds in cpp_build.builds_paid().items()
              if name not in paid_before}
    setup_ms = max(0.0, setup_ms - 1000 * sum(builds.values()))
    try:
        out, first_ms = timed_once(lambda: kernel(*first), device.synchronize)  # type: ignore[operator]
    except Exception as error:
        status = Status.COMPILE_ERROR if _is_compile_error(error) else Status.RUNTIME_ERROR
        raise GateFailure(status, f"first call failed: {describe(error)}") from error
    outputs = spec.as_outputs(out)
    tolerance = spec.tolerance(dtype)
    accuracy = check_values(outputs, references, spec, like, tolerance)
    check_mutation(first, originals, spec, variant.inplace)
    measured = Measured(
        spec, variant, device, sets, kernel, tolerance, like, threads, builds  # type: ignore[arg-type]
    )
    if measured.memory_rules or variant.inplace:
        check_memory(outputs, first, spec, variant.inplace)
    return measured, setup_ms, first_ms, accuracy


def timed_and_checked(
    m: Measured, count: int, settings: TimingSettings, cold: bool
) -> Timing:
    """The timing loop over `count` input sets, gated: the clock cross-check, what the variant
    did while measured (audit hook, replaced code, threads beyond the cell's), every input set
    unchanged before and after, and the kept timed calls through the whole gate (fresh memory
    the variant no longer holds, then values), the refill probe's call (measure/probe.py)
    included."""
    m.sets.ensure(count)
    args = m.sets.sets[:count]
    inplace = bool(m.variant.inplace)
    if not inplace:
        check_sets_unchanged(m, count, "before timing")
    m.prepare(count)
    probe = Probe(args) if m.memory_rules else None
    loop = time_calls(
        lambda i: m.kernel(*args[i]),
        count,
        m.device.synchronize,
        settings,
        snapshot=(lambda i: _copy_outputs(args[i])) if inplace else None,
        keep_copy=_copy_outputs if inplace else None,
        flush=m.device.flush_cache if cold and m.device.event_device_types else None,
        time_one=m.device.time_one,
        working_set_bytes=count * m.sets.bytes_per_set,
        threads=m.threads if m.device.type == "cpu" else 0,
        probe=probe,
    )
    reason = loop.reason()
    if reason:
        raise GateFailure(Status.SUSPICIOUS, reason)
    # Each output once, in one list each: the only references this side holds.
    kept = [(index, list(m.spec.as_outputs(out))) for index, out in loop.kept]
    loop.kept.clear()
    if not inplace:
        check_sets_unchanged(m, count, "during timing")
    altered, probed = _probe_reference(m, probe, loop)
    if m.memory_rules:
        _check_kept_memory(m, kept, args)
    _check_kept_values(m, kept, loop, probe, altered)
    if altered is not None and probed is not None:  # last: what the rules above let through;
        # a row-wise op's call is judged on the row the probe changed
        _check_probe(m, probe, altered, probed[0],  # type: ignore[arg-type]
                     "in its first call after it", rows=probed[1])
    return loop.timing


def _probe_reference(
    m: Measured, probe: Probe | None, loop: TimedLoop
) -> tuple[ChangedReference | None, tuple[object, bool] | None]:
    """The float64 reference of the values the refill probe made (once for every call made on
    them), and the probe's own call: copied, or its changed row alone where the op is row-wise
    (then True), so the memory rules that count who holds the kept outputs see no extra one."""
    altered = (probe.reference(m.spec, m.sets.reference) if probe is not None
               and probe.index >= 0 and (loop.probed is not None or loop.altered_kept) else None)
    probed = None
    if altered is not None and loop.probed is not None:
        rows = altered.rows_of(m.spec.as_outputs(loop.probed))
        probed = (rows, True) if rows is not None else (_copy_outputs(loop.probed), False)
    loop.probed = None
    return altered, probed


def _check_kept_memory(
    m: Measured, kept: list[tuple[int, list[object]]], args: list[tuple[object, ...]]
) -> None:
    """The memory rules on the kept timed calls: no output still held by the variant, then
    fresh memory (a reused buffer also makes values wrong, so memory is judged first)."""
    for _, outputs in kept:
        check_not_retained(outputs)
    held: list[torch.Tensor] = []
    for index, outputs in kept:
        held += check_memory(outputs, args[index], m.spec, {}, held)
    del held


def _check_kept_values(
    m: Measured, kept: list[tuple[int, list[object]]], loop: TimedLoop, probe: Probe | None,
    altered: ChangedReference | None,
) -> None:
    """The values of every kept timed call: against its set's reference, the copy of its inputs
    taken before the call for a variant that writes into them, or the probe's changed values."""
    for number, (index, outputs) in enumerate(kept):
        where = f"in timed call {number + 1}"
        if number in loop.altered_kept:  # made on the probe's changed values
            _check_probe(m, probe, altered, outputs, where)  # type: ignore[arg-type]
            continue
        if m.variant.inplace:
            references = m.spec.reference(loop.kept_inputs[number])  # type: ignore[arg-type]
        else:
            references = m.sets.reference(index)
        check_values(outputs, references, m.spec, m.like, m.tolerance, where)


def _check_probe(
    m: Measured, probe: Probe, altered: ChangedReference, out: object, where: str,
    rows: bool = False,
) -> None:
    """A call made after the probe changed one value of its set must follow the new value;
    with `rows`, `out` is the changed row of each output, judged against that row's reference."""
    outputs = out if rows else m.spec.as_outputs(out)
    try:
        if rows:
            check_values(outputs, altered.rows, m.spec, m.like, m.tolerance)  # type: ignore[arg-type]
        else:
            with altered.swapped() as references:
                check_values(outputs, references, m.spec, m.like, m.tolerance)
    except GateFailure as failure:
        when = (f"in the timing loop, after one value (flat index {probe.position}) of input set "
                f"{probe.index} changed between two samples (same tensor, same address), {where}")
        old = altered.old_rows if rows else m.sets.reference(probe.index)
        if _matches(m, outputs, old):  # type: ignore[arg-type]
            raise GateFailure(Status.STALE_RESULT, f"refill probe: {when}, it gave the answer to "
                              f"the old values: {failure}") from None
        raise GateFailure(Status.INCORRECT, f"refill probe: {when}: {failure}") from None


def check_sets_unchanged(m: Measured, count: int, when: str) -> None:
    """Every input set's values as generated (checksums): a variant that does not declare
    in-place outputs writes no input, and references are computed from untouched values."""
    if not rules.on("sets_checksummed"):
        return
    modified = m.sets.modified(count)
    if modified:
        raise GateFailure(
            Status.INCORRECT,
            f"input set(s) {modified[:5]} changed {when}: the variant writes into inputs it does "
            "not declare in place",
        )


def _copy_outputs(out: object) -> object:
    """A copy of a kernel's outputs, or of an input tuple: tensors cloned, the rest as is."""
    if isinstance(out, (tuple, list)):
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
    return out.clone() if isinstance(out, torch.Tensor) else out


def check_follows_new_values(m: Measured) -> None:
    """New values written into the same tensors (same address, same version counter) must give
    the new answer: all values at once, then one element far from the start (a kernel that
    hashes part of its input to reuse results misses it). A wrong answer that is the answer to
    the values before the change is `stale_result`; any other wrong answer is `incorrect`."""
    if not rules.on("refill"):
        return
    target = m.sets.sets[0]
    saved = _copy_outputs(target)
    # New values from a seed no variant can know, at a place no variant can know.
    fresh = m.spec.make_inputs(m.sets.shape, m.sets.dtype, m.sets.device, draw(2**31))
    try:
        refill_in_place(target, fresh)
        m.forget_saved()
        _check_new_answer(m, target, saved, "after all its input values changed in place")
        first = tensors_in(target)[0]
        flat = first.data.view(-1) if first.is_contiguous() else None
        if flat is not None and flat.numel() > 1 and rules.on("refill_far_value"):
            # An in-place variant has written its outputs into the inputs since `fresh`.
            before = _copy_outputs(target) if m.variant.inplace else fresh
            index = flat.numel() - 1 - draw(max(flat.numel() // 2, 1))
            flat[index] = flat[index] * -2 + 1
            m.forget_saved()
            when = f"after one value (flat index {index}) changed in place"
            _check_new_answer(m, target, before, when)
    finally:
        refill_in_place(target, saved)
        m.forget_saved()


def _check_new_answer(
    m: Measured, inputs: tuple[object, ...], before: tuple[object, ...], when: str
) -> None:
    references = m.spec.reference(inputs)
    outputs = m.spec.as_outputs(m.kernel(*inputs))
    try:
        check_values(outputs, references, m.spec, m.like, m.tolerance)
    except GateFailure as failure:
        if not rules.on("stale_only_old_answer") or _answers(m, outputs, before):
            message = f"{when} (same tensor, same address), it gave the answer to the old values"
            raise GateFailure(Status.STALE_RESULT, f"{message}: {failure}") from None
        raise GateFailure(Status.INCORRECT, f"{when}: {failure}") from None


def _answers(m: Measured, outputs: tuple[object, ...], inputs: tuple[object, ...]) -> bool:
    """Whether `outputs` are the right answer to `inputs` (values the variant saw earlier)."""
    return _matches(m, outputs, m.spec.reference(inputs))


def _matches(m: Measured, outputs: Sequence[object], references: Sequence[torch.Tensor]) -> bool:
    """Whether `outputs` pass the value check against `references`."""
    try:
        check_values(outputs, references, m.spec, m.like, m.tolerance)
    except GateFailure:
        return False
    return True


def copy_limit(
    device: Device, dtype: torch.dtype, nbytes: int, cold: bool, again: bool = False
) -> CopyLimits:
    """The device's copy bandwidth at this size class, once per worker process (`again`:
    measure anew and keep the better figure: noise only ever slows a copy)."""
    known = _LIMITS.get(device.type, dtype, nbytes, cold)
    if known is None or again:
        watch = disturbance.Watch()  # disturbance: a limit measured while busy is marked
        fresh = measure_copy_limits(
            device.type, dtype, nbytes, device.synchronize, cold, device.cache_bytes()
        )
        fresh.note = disturbance.mark_busy(fresh.note, watch.stop())
        quiet_limits.remember(device, fresh)  # a quiet one judges later busy moments
        if known is None or fresh.limit_gbps > known.limit_gbps:
            _LIMITS.put(fresh)
    return _LIMITS.get(device.type, dtype, nbytes, cold) or known  # type: ignore[return-value]


class _Phases:
    """Wall time per phase of a trial, into the record (what the harness costs, and where)."""

    def __init__(self, record: TrialRecord) -> None:
        self._record, self._last = record, now_s()

    def end(self, name: str) -> None:
        now = now_s()
        self._record.phases_s[name] = self._record.phases_s.get(name, 0.0) + now - self._last
        self._last = now


def _measure(task: TrialTask, record: TrialRecord) -> None:
    cell = task.cell
    phase = _Phases(record)
    m, record.setup_ms, record.first_call_ms, record.accuracy = build_and_gate(
        cell, task.variant, task.params, task.seed
    )
    record.builds_s = m.builds_s
    phase.end("inputs, build, first call")
    if task.screen is not None:  # screen: a brief warm timing; stop here if it cannot win
        screen = task.screen

        def time_brief() -> tuple[Timing, disturbance.Disturbance | None]:
            watch = disturbance.Watch()
            brief = timed_and_checked(m, WARM_SETS, screen.timing, cold=False)
            return brief, watch.stop()

        ruled_out = screen.rules_out(time_brief, record)
        phase.end("screen")
        if ruled_out:
            return
    dtype = torch_dtype(cell.dtype)
    record.bytes_moved = m.spec.bytes_moved(cell.shape, dtype)
    _time_quietly(task, m, record, phase)
    record.accuracy.checked_calls = 1 + 2 * task.timing.checked_calls
    check_follows_new_values(m)
    latencies = {mode: record.latency_ms(mode) or 0.0 for mode in ("warm", "cold")}
    record.limits = check_bandwidth(m, record.bytes_moved, latencies)
    phase.end("gate checks, copy limits")
    _profile(task, record, m)
    phase.end("profiler pass")
    if isinstance(m.kernel, PassCall):
        record.memory = pass_memory(m.kernel, m.sets.sets[0], m.device.torch_device)
        phase.end("pass memory")


def _time_warm_and_cold(task: TrialTask, m: Measured, record: TrialRecord, phase: _Phases) -> None:
    record.timing = timed_and_checked(m, WARM_SETS, task.timing, cold=False)
    phase.end("warm timing")
    cold_count, record.cold_note = m.sets.cold_count(m.device.cache_bytes())
    if cold_count > WARM_SETS or m.device.event_device_types:
        record.cold = timed_and_checked(m, cold_count, task.timing, cold=True)
    phase.end("cold timing")


def _time_quietly(task: TrialTask, m: Measured, record: TrialRecord, phase: _Phases) -> None:
    """Time warm and cold under a disturbance watch; a window that other processes disturbed
    is measured again, at most DISTURBED_RETRIES times, keeping the least disturbed attempt.
    What stays disturbed is recorded so (`record.disturbance`) and marked wherever it shows."""
    attempts: list[tuple[float, Timing | None, Timing | None, dict[str, Any]]] = []
    while len(attempts) <= DISTURBED_RETRIES:
        watch = disturbance.Watch()
        _time_warm_and_cold(task, m, record, phase)
        seen = watch.stop()
        share = seen.other_share if seen is not None else 0.0
        attempts.append((share, record.timing, record.cold, seen.to_dict() if seen else {}))
        if seen is None or not seen.disturbed:
            break
    _, record.timing, record.cold, window = min(attempts, key=lambda attempt: attempt[0])
    record.disturbance = disturbance.window_of(window, len(attempts))


def check_bandwidth(
    m: Measured, bytes_moved: int, latencies_ms: dict[str, float]
) -> dict[str, CopyLimits]:
    """No latency (ms per call, by rank mode) may move the op's bytes faster than this device
    copies them (limits.SLACK); returns the copy limits each mode was judged against. A limit
    that stays busy when measured again is replaced by the last quiet limit of this machine
    (measure/quiet_limits.py); with none stored, the trial is `unjudged` (it cannot win)."""
    dtype = m.like.dtype
    x_bytes = m.like.numel() * m.like.element_size()
    limits = {}
    for mode, latency_ms in latencies_ms.items():
        limit = copy_limit(m.device, dtype, x_bytes, cold=mode == "cold")
        achieved = bytes_moved / (latency_ms * 1e-3) / 1e9 if latency_ms else 0.0
        reason = suspicious_reason(achieved, limit)
        for _ in range(_REMEASURES if reason and rules.on("copy_remeasured") else 0):
            # A busy moment may have slowed the copy: measure it again before any verdict.
            limit = copy_limit(m.device, dtype, x_bytes, cold=mode == "cold", again=True)
            reason = suspicious_reason(achieved, limit)
            if reason is None:
                break
        if reason and disturbance.BUSY_NOTE in limit.note and rules.on("busy_copy_limit"):
            # disturbance: a copy limit measured on a busy machine is no yardstick
            quiet = quiet_limits.last_quiet(m.device, dtype, x_bytes, cold=mode == "cold")
            if quiet is None:
                raise GateFailure(
                    Status.UNJUDGED,
                    f"{mode} not judged: {reason}; that limit was {limit.note}, and no quiet "
                    "copy limit of this machine is stored to judge by",
                )
            note = "the last quiet limit of this machine (the one measured now was busy)"
            limit = dataclasses.replace(quiet, note="; ".join(n for n in (quiet.note, note) if n))
            reason = suspicious_reason(achieved, limit)
            if reason:
                reason += (" (judged against the last quiet copy limit of this machine: the one "
                           "measured now stayed busy)")
        limits[mode] = limit
        if reason and rules.on("copy_bandwidth"):
            raise GateFailure(Status.SUSPICIOUS, f"{mode}: {reason}")
    return limits


def _profile(task: TrialTask, record: TrialRecord, m: Measured) -> None:
    first = m.sets.sets[0]
    m.prepare(1)
    extra = m.device.profiler_extra(task.trace_dir)
    prof = profile_calls(lambda: m.kernel(*first), m.device, task.profiler, extra)
    record.fusion = fusion_accounting(prof, m.device)
    if record.fusion.device_time_us is None and m.device.event_device_types:
        # The backend kept its device timeline to itself: read it from the device's own profile.
        seconds, why = m.device.profile_device_time(extra, task.profiler.active)
        if seconds is not None:
            record.fusion.device_time_us = seconds * 1e6
        record.fusion.note = "; ".join(n for n in (record.fusion.note, why) if n)
    if task.profile_table_rows:
        record.profile_table = key_averages_table(prof, m.device, task.profile_table_rows)
    if task.trace_dir is not None:
        stem = f"{task.cell.op}_{task.variant}_{format_shape(task.cell.shape)}_{task.cell.dtype}"
        record.trace_file = export_trace(prof, task.trace_dir, stem)
    check_device_work(record.fusion, prof, m)


def check_device_work(fusion: Fusion, prof: object, m: Measured) -> None:
    """The profiler must see the op's work: device ops, and on the CPU operators that take at
    least the op's input elements per call (not one token op beside work hidden from it)."""
    if fusion.device_ops == 0 and rules.on("device_ops"):
        raise GateFailure(
            Status.SUSPICIOUS,
            f"0 device ops per call: the profiler saw no work on {m.device.type} "
            "(a result handed back without computing, or work hidden from the profiler)",
        )
    if m.device.event_device_types or isinstance(m.kernel, PassCall):
        # The profiler records no input shapes for the ops autograd's engine runs in a
        # backward, so a pass is held to the rule above (it saw device ops) alone.
        return
    needed = sum(t.numel() for t in tensors_in(m.sets.sets[0]))
    seen = operator_input_elements(prof)  # type: ignore[arg-type]
    if seen < needed and rules.on("device_work"):
        raise GateFailure(
            Status.SUSPICIOUS,
            f"the operators the profiler saw took {seen:.0f} input elements per call, fewer than "
            f"the op's {needed}: the work is done where the profiler cannot see it",
        )

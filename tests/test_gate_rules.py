"""Every rule of the gate and every status, end to end through a real trial.

Each variant in `tests/plugins/rule_breakers.py` breaks one rule and is otherwise honest, so each
test fails when its rule is taken out of `fusionlab/measure/` (checked by removing each rule in
turn: `python benchmarks/rule_removal.py`). The assertions name the rule's own message,
so a different rule catching the variant by luck does not count.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from conftest import PLUGINS, cpu_cell
from helpers import TRIAL_TIMING as FAST

from fusionlab.devices import get_device
from fusionlab.measure import quiet_limits, trial
from fusionlab.measure.correctness import GateFailure
from fusionlab.measure.disturbance import BUSY_NOTE
from fusionlab.measure.limits import SLACK, LimitsCache, size_class
from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import CopyLimits, Status, TrialRecord
from fusionlab.registry import load_plugin

PLUGIN = str(PLUGINS / "rule_breakers.py")
load_plugin(PLUGIN)

RMS_SHAPE = (4, 96)
COPY_SHAPE = (64, 256)


def _trial(variant: str, op: str = "rmsnorm", shape: tuple[int, ...] = RMS_SHAPE) -> TrialRecord:
    return run_trial(TrialTask(cpu_cell(op, shape), variant, {}, seed=11, timing=FAST))


def _in_worker(variant: str, timeout_s: float) -> TrialRecord:
    task = TrialTask(cpu_cell("rmsnorm", RMS_SHAPE), variant, {}, seed=11, timing=FAST)
    with TrialWorker([PLUGIN]) as worker:
        return TrialRecord.from_dict(worker.run(task, timeout_s))


def _refilled(variant: str) -> TrialRecord:
    """The refill check after the loops alone, on a kernel built and gated by its first call
    (in a trial the refill probe inside the timing loop, measure/probe.py, comes first)."""
    task = TrialTask(cpu_cell("rmsnorm", RMS_SHAPE), variant, {}, seed=11, timing=FAST)
    record = task.new_record(Status.PASSED)
    measured, *_ = trial.build_and_gate(task.cell, variant, {}, task.seed)
    try:
        trial.check_follows_new_values(measured)
    except GateFailure as failure:
        record.status, record.message = failure.status, str(failure)
    return record


def _assert_status(record: TrialRecord, status: Status, *phrases: str) -> None:
    assert record.status is status, (record.status, record.message)
    for phrase in phrases:
        assert phrase in record.message, record.message


# --- the honest controls: the rules below do not flag everything ---------------------------


@pytest.mark.parametrize(("op", "variant", "shape"), [
    ("rmsnorm", "naive", RMS_SHAPE),
    ("rbcopy", "clone", COPY_SHAPE),
    ("add_rmsnorm", "builtin-inplace", (4, 64)),  # in place as declared: writes its inputs
])
def test_an_honest_variant_passes_every_rule(op: str, variant: str, shape) -> None:
    record = _trial(variant, op, shape)
    assert record.status is Status.PASSED, record.message
    assert record.timing is not None and record.fusion is not None
    assert record.fusion.device_ops and record.fusion.device_ops >= 1


# --- incorrect --------------------------------------------------------------------------


def test_wrong_values_are_incorrect() -> None:
    record = _trial("rb-off-by-eps")
    _assert_status(record, Status.INCORRECT, "y: max abs error", "exceeds atol=")


def test_values_wrong_only_after_the_first_call_are_caught_in_the_timed_calls() -> None:
    record = _trial("rb-wrong-after-first")
    _assert_status(record, Status.INCORRECT, "in timed call")


def test_a_first_call_that_changes_an_undeclared_input_is_incorrect() -> None:
    record = _trial("rb-mutates-weight")
    _assert_status(record, Status.INCORRECT, "modified input 'weight'", "does not declare")


def test_input_sets_changed_by_later_calls_with_right_outputs_are_incorrect() -> None:
    """Every output is right (RMSNorm ignores the scale of x), the first call leaves its inputs
    alone: only the input-set check after timing can see what the later calls did."""
    record = _trial("rb-scales-input-later")
    _assert_status(record, Status.INCORRECT, "changed during timing")


def test_a_variant_that_changes_its_inputs_only_on_later_calls_is_incorrect() -> None:
    """It negates x after computing on calls 2, 3, ...: the first-call gate sees nothing."""
    record = _trial("rb-corrupts-input-later")
    assert record.status is Status.INCORRECT, record.message
    assert "timed call" in record.message or "changed during timing" in record.message


def test_an_in_place_variant_wrong_on_later_calls_is_incorrect() -> None:
    """Its inputs change with every call, so each kept call is judged against the reference of
    the values it was given."""
    record = _trial("rb-inplace-wrong-later", "add_rmsnorm", (4, 64))
    _assert_status(record, Status.INCORRECT, "y in timed call", "max abs error")


# --- reused_memory ------------------------------------------------------------------------


def test_an_output_that_is_the_unchanged_input_is_reused_memory() -> None:
    """y = x is right in value and leaves x alone: only the alias rule can refuse it."""
    record = _trial("rb-returns-input", "rbcopy", COPY_SHAPE)
    _assert_status(record, Status.REUSED_MEMORY, "y aliases input 'x'")


def test_one_buffer_handed_out_on_every_call_is_reused_memory() -> None:
    record = _trial("rb-static-buffer")
    assert record.status is Status.REUSED_MEMORY, record.message
    # Caught at once by "still held by the variant", else by the shared-storage rule.
    assert ("still held by the variant" in record.message
            or "reuses the storage of an output" in record.message), record.message


# --- stale_result -------------------------------------------------------------------------


def test_a_result_cached_by_input_address_is_stale() -> None:
    record = _refilled("rb-cache-by-pointer")
    _assert_status(record, Status.STALE_RESULT, "changed in place", "answer to the old values")
    in_loop = _trial("rb-cache-by-pointer")  # a whole trial: the probe inside the loop finds it
    _assert_status(in_loop, Status.STALE_RESULT, "answer to the old values")


def test_a_result_cached_by_its_first_values_is_stale_after_one_far_value_changes() -> None:
    """Every value changed at once is a new key for it: only the one-element change finds it."""
    record = _refilled("rb-cache-by-head")
    _assert_status(record, Status.STALE_RESULT, "after one value (flat index",
                   "answer to the old values")


def test_a_wrong_answer_after_an_in_place_change_that_is_not_the_old_one_is_incorrect() -> None:
    """Only the old answer is stale: other wrong values after the change are `incorrect`."""
    record = _refilled("rb-garbage-after-refill")
    _assert_status(record, Status.INCORRECT, "after all its input values changed in place")


# --- suspicious ---------------------------------------------------------------------------


def test_bandwidth_beyond_the_devices_copy_is_suspicious() -> None:
    """An honest clone, measured against a spec that claims 10 000x the bytes it moves."""
    record = _trial("clone", "rbcopy_overclaimed", COPY_SHAPE)
    assert record.timing is not None  # it was timed, then judged
    if record.status is Status.UNJUDGED:  # the one way out: busy, and no quiet limit stored
        assert "that limit was measured while the machine was busy" in record.message
        pytest.skip(f"the copy limit was measured on a busy machine: {record.message}")
    _assert_status(record, Status.SUSPICIOUS, f"flagged above {SLACK:g}x")


def _plant_limits(nbytes: int, gbps: float, note: str) -> None:
    """Copy limits for `nbytes` of float32 on this CPU, as if measured: `gbps` far above what
    this machine copies, so measuring the copy again never replaces them."""
    for cold in (False, True):
        planted = CopyLimits("cpu", "float32", nbytes, size_class(nbytes), gbps, gbps, cold, cold,
                             1, None, note)
        trial._LIMITS.put(planted)


@pytest.fixture
def own_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy-limit cache of the test's own: what it plants is gone after it."""
    monkeypatch.setattr(trial, "_LIMITS", LimitsCache())


@pytest.mark.usefixtures("own_limits")
def test_bandwidth_beyond_a_quiet_copy_limit_is_suspicious_on_a_busy_machine_too() -> None:
    """The same overclaiming clone, judged against a limit measured quietly (planted at
    1000 GB/s, several times this machine's copy): the verdict cannot wait for a quiet moment."""
    _plant_limits(COPY_SHAPE[0] * COPY_SHAPE[1] * 4, 1000.0, "")
    record = _trial("clone", "rbcopy_overclaimed", COPY_SHAPE)
    assert record.timing is not None
    _assert_status(record, Status.SUSPICIOUS, "warm: ", f"flagged above {SLACK:g}x",
                   "(1e+03 GB/s")


@pytest.mark.usefixtures("own_limits")
def test_an_honest_copy_under_a_quiet_copy_limit_passes() -> None:
    """The control: the same clone, claiming only the bytes it moves, is judged against the
    planted quiet limit (not skipped for a busy machine) and passes."""
    _plant_limits(COPY_SHAPE[0] * COPY_SHAPE[1] * 4, 1000.0, "")
    record = _trial("clone", "rbcopy", COPY_SHAPE)
    assert record.status is Status.PASSED, record.message
    assert "not judged" not in record.message
    assert all(limit.limit_gbps == 1000.0 for limit in record.limits.values())


@pytest.fixture
def no_quiet_limits(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A store of quiet copy limits of the test's own, empty at the start."""
    monkeypatch.setenv("FUSIONLAB_CACHE_DIR", str(tmp_path))


@pytest.mark.usefixtures("own_limits")
def test_a_copy_limit_measured_while_busy_with_no_quiet_one_stored_leaves_it_unjudged(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The overclaiming clone against a limit marked busy and nothing quiet to judge by (the
    store cannot be written: a file where its folder should be): not condemned, not passed
    either (it cannot win), and the record says why."""
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("FUSIONLAB_CACHE_DIR", str(tmp_path / "not-a-folder"))
    _plant_limits(COPY_SHAPE[0] * COPY_SHAPE[1] * 4, 1000.0, f"{BUSY_NOTE} (planted)")
    record = _trial("clone", "rbcopy_overclaimed", COPY_SHAPE)
    _assert_status(record, Status.UNJUDGED, "not judged: ", f"that limit was {BUSY_NOTE} "
                   "(planted)", "no quiet copy limit of this machine is stored")


@pytest.mark.usefixtures("own_limits", "no_quiet_limits")
def test_a_copy_limit_that_stays_busy_is_replaced_by_the_last_quiet_one() -> None:
    """A busy yardstick (a CPU hog beside the copy, or a variant's own child burning CPU) does
    not knock the rule over: the last quiet limit of this machine judges instead."""
    nbytes = COPY_SHAPE[0] * COPY_SHAPE[1] * 4
    for cold in (False, True):
        quiet = CopyLimits("cpu", "float32", nbytes, size_class(nbytes), 2000.0, 2000.0, cold,
                           cold, 1, None, "")
        quiet_limits.remember(get_device("cpu"), quiet)
    _plant_limits(nbytes, 1000.0, f"{BUSY_NOTE} (planted)")
    record = _trial("clone", "rbcopy_overclaimed", COPY_SHAPE)
    _assert_status(record, Status.SUSPICIOUS, f"flagged above {SLACK:g}x",
                   "judged against the last quiet copy limit of this machine")
    honest = _trial("clone", "rbcopy", COPY_SHAPE)
    assert honest.status is Status.PASSED, honest.message


def test_work_the_profiler_cannot_see_is_suspicious() -> None:
    record = _trial("rb-numpy-hidden")
    _assert_status(record, Status.SUSPICIOUS, "0 device ops per call")


def test_the_copy_is_measured_again_before_a_suspicious_verdict() -> None:
    """A copy limit measured in a busy moment (here: planted at a millionth of a real one) must
    not condemn an honest variant: the worker measures the copy anew before the verdict."""
    shape = (4, 112)  # a size class of its own, so no earlier trial measured its copy
    cell = cpu_cell("rmsnorm", shape)
    nbytes = shape[0] * shape[1] * 4
    planted = {}
    for cold in (False, True):
        slow = CopyLimits("cpu", "float32", nbytes, 0, 1e-6, 1e-6, cold, cold, 1, None)
        slow = dataclasses.replace(slow, size_class=size_class(nbytes))
        trial._LIMITS.put(slow)
        planted[cold] = slow
    record = run_trial(TrialTask(cell, "naive", {}, seed=11, timing=FAST))
    assert record.status is Status.PASSED, record.message
    for mode, cold in (("warm", False), ("cold", True)):
        assert record.limits[mode].limit_gbps > 1e3 * planted[cold].limit_gbps


def test_a_variant_that_replaces_the_clock_is_suspicious(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "perf_counter", time.perf_counter)  # put back after the test
    record = _trial("rb-stops-the-clock")
    _assert_status(record, Status.SUSPICIOUS, "time.perf_counter",
                   "a variant may not touch the clocks that time it")


# --- runtime_error and compile_error ------------------------------------------------------


@pytest.mark.parametrize(("variant", "status", "words"), [
    pytest.param("rb-raises-first", Status.RUNTIME_ERROR, ("first call failed", "ValueError"),
                 id="a-first-call-that-raises"),
    pytest.param("rb-raises-later", Status.RUNTIME_ERROR, ("kernel gave up on call 5",),
                 id="a-later-call-that-raises"),
    pytest.param("rb-setup-fails", Status.COMPILE_ERROR, ("setup failed", "cannot build"),
                 id="a-factory-that-fails"),
    pytest.param("rb-graph-break-fullgraph", Status.COMPILE_ERROR, ("first call failed",),
                 id="a-first-call-that-fails-to-compile"),
])
def test_failures_to_run_or_build_are_runtime_or_compile_errors(
        variant: str, status: Status, words: tuple[str, ...]) -> None:
    _assert_status(_trial(variant), status, *words)


# --- timeout and crashed, in the isolated worker a sweep uses -------------------------------


def test_a_call_that_never_returns_is_a_timeout() -> None:
    record = _in_worker("rb-hangs-later", timeout_s=4)
    _assert_status(record, Status.TIMEOUT, "no result within 4 s")


def test_a_worker_that_exits_mid_trial_is_crashed() -> None:
    record = _in_worker("rb-exits-later", timeout_s=300)
    _assert_status(record, Status.CRASHED, "exited with code 3")

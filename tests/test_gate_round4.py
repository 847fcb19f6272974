"""The gate, round four: the measuring process defends itself. Cheats on the process (entropy,
profile functions, frame introspection, ctypes, threads and children, replaced code, more
threads than the cell) are caught through the real worker, search trial then re-measurement
rounds and audit, with the rule named; honest controls pass."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import PLUGINS, cpu_cell, search_then_decision
from helpers import GATE_TIMING as FAST
from test_disturbance import hogs  # noqa: F401  (a fixture: one busy process per core)

from fusionlab.measure import events, integrity
from fusionlab.measure.timing import Gaps, TimedLoop, TimingSettings, draw, time_calls
from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import Status, Timing
from fusionlab.registry import load_plugin

ROUND4 = str(PLUGINS / "gaming_round4.py")
load_plugin(ROUND4)
load_plugin(str(PLUGINS / "gaming_honest.py"))
EXPECTED = next(m for n, m in sys.modules.items()
                if n.startswith("fusionlab_plugin_gaming_round4_")).EXPECTED
CASES = [(group, name, statuses, word) for group, cases in EXPECTED.items()
         for name, statuses, word in cases]


@pytest.fixture(scope="module")
def worker():
    with TrialWorker(plugins=[ROUND4]) as trial_worker:
        yield trial_worker


@pytest.mark.parametrize(("group", "variant", "statuses", "word"), CASES)
def test_round_four_cheat_is_caught_with_the_rule_named(worker, group, variant, statuses,
                                                        word) -> None:
    outcome = search_then_decision(worker, variant)
    assert outcome["status"] in statuses, f"{group}: {variant}: {outcome['message']}"
    assert word in outcome["message"] and "\n" not in outcome["message"], outcome["message"]


def test_after_a_cheat_swapped_the_gates_code_the_next_trial_runs_in_a_fresh_process(worker):
    """The worker retires after a variant replaced the code of a gate check in place; the
    built-in measured next passes (the replacement did not outlive the process)."""
    cell = cpu_cell("rmsnorm", (8, 256))
    caught = worker.run(TrialTask(cell, "r4-swap-code-of-gate", {}, timing=FAST), 300)
    assert caught["status"] == Status.SUSPICIOUS.value, caught["message"]
    honest = worker.run(TrialTask(cell, "builtin", {}, timing=FAST), 300)
    assert honest["status"] == Status.PASSED.value, honest["message"]


def test_more_threads_than_a_one_thread_cell_are_suspicious() -> None:
    """`--threads 1`: a variant that leaves torch's thread count raised is caught after the
    sample (and its worker retired); one that restores it before returning is caught by the
    CPU time its loop used, when the machine has a second core free to give it."""
    cell = cpu_cell("rmsnorm", (256, 4096))
    with TrialWorker(plugins=[ROUND4], threads=1) as one_thread:
        caught = one_thread.run(TrialTask(cell, "r4-threads-left-raised", {}, timing=FAST), 300)
        assert caught["status"] == Status.SUSPICIOUS.value, caught["message"]
        assert "thread count was not the cell's 1" in caught["message"]
        honest = one_thread.run(TrialTask(cell, "builtin", {}, timing=FAST), 300)
        assert honest["status"] == Status.PASSED.value, honest["message"]
        slow = TimingSettings(warmup_s=0.05, budget_s=0.3, min_samples=10, max_samples=100)
        hidden = one_thread.run(TrialTask(cell, "r4-threads-raised-in-call", {}, timing=slow),
                                300)
    if hidden["status"] == Status.PASSED.value:
        pytest.skip(f"no second core was free to run the hidden threads: {hidden['message']}")
    assert hidden["status"] == Status.SUSPICIOUS.value, hidden["message"]
    assert "cell of 1 thread" in hidden["message"]


def test_cpu_time_beyond_the_cells_threads_is_suspicious() -> None:
    timing = Timing(1.0, 1.0, 1.0, 1.0, 0.0, 1, [1.0])
    assert TimedLoop(timing, [], clock_s=1.0, cpu_s=1.2, threads=1).threads_reason() is None
    reason = TimedLoop(timing, [], clock_s=1.0, cpu_s=1.9, threads=1).threads_reason()
    assert reason is not None and "cell of 1 thread" in reason
    assert TimedLoop(timing, [], clock_s=1.0, cpu_s=1.9, threads=2).threads_reason() is None


def test_an_in_place_loop_checks_calls_at_any_place_in_a_sample() -> None:
    """For a variant that writes into its inputs, the checked call is drawn after the sample
    among all its calls (not always its first, which a variant could tell by the pause before
    it), and comes with the copy of its inputs taken before it."""
    sets = [torch.zeros(1), torch.zeros(1)]
    numbers: list[int] = []

    def call(index: int) -> torch.Tensor:
        numbers.append(len(numbers) + 1)
        return sets[index].fill_(numbers[-1])

    settings = TimingSettings(warmup_s=0.0, budget_s=1.0, min_samples=30, max_samples=30,
                              min_sample_s=2e-4, checked_calls=15)
    loop = time_calls(call, 2, lambda: None, settings, snapshot=lambda i: sets[i].clone(),
                      keep_copy=lambda out: out.clone())  # type: ignore[arg-type, return-value]
    per_sample = loop.timing.calls_per_sample
    assert per_sample > 1 and loop.kept
    first_sampled = len(numbers) - 30 * per_sample + 1
    places = {(int(out.item()) - first_sampled) % per_sample for _, out in loop.kept}
    assert len(places) > 1, places
    for (_, out), before in zip(loop.kept, loop.kept_inputs, strict=True):
        assert int(before.item()) < int(out.item())  # type: ignore[union-attr]


def test_untimed_gaps_are_judged_by_the_harnesss_own_measured_cost() -> None:
    """CPU time in the gaps beyond the harness's own cost (plus a share of the timed windows') is
    suspicious; the harness's own copies after in-place calls are not counted as the variant's."""
    honest = Gaps(window_cpu_ns=9_000_000, gap_cpu_ns=50_000, walls_ns=[20_000] * 8,
                  harness_cpu_ns=10_000)
    assert honest.reason() is None
    hidden = Gaps(window_cpu_ns=9_000_000, gap_cpu_ns=8_000_000, walls_ns=[1_000_000] * 8,
                  harness_cpu_ns=10_000)
    assert "of CPU time ran in the 8 gaps" in (hidden.reason() or "")
    copying = Gaps(window_cpu_ns=9_000_000, gap_cpu_ns=8_000_000, walls_ns=[1_000_000] * 8,
                   harness_cpu_ns=10_000, copies_cpu_ns=7_900_000)
    assert copying.reason() is None


@pytest.mark.parametrize("variant", ["builtin", "honest-in-place"])
def test_honest_gaps_beside_a_cpu_hog_are_not_suspicious(hogs, variant: str) -> None:  # noqa: F811
    """Another process on every core interrupts the gaps; the gap rule does not take that for
    work the variant hid there (the search trial, at a small and a large shape)."""
    for shape in ((8, 256), (256, 4096)):
        record = run_trial(TrialTask(cpu_cell("rmsnorm", shape), variant, {}, timing=FAST))
        assert "untimed gaps" not in record.message, record.message
        assert record.status in (Status.PASSED, Status.UNJUDGED), record.message


def test_the_audit_hook_names_what_a_watched_call_did_and_nothing_outside() -> None:
    sys._getframe(0)  # not watched: not noted
    with events.watching() as noted:
        torch.ones(4).sum()
    assert noted == []
    with events.watching() as noted:
        sys._getframe(0)
    assert noted == ["sys._getframe"]


def test_a_replaced_torch_function_is_named_and_dynamos_own_wrapper_is_not() -> None:
    integrity.seal()
    original = torch.rms_norm
    try:
        torch.rms_norm = torch._disable_dynamo(original)  # what importing torch._dynamo does
        assert integrity.replaced() is None
        torch.rms_norm = lambda *args, **kwargs: original(*args, **kwargs)
        assert integrity.replaced() == "torch.rms_norm"
    finally:
        torch.rms_norm = original
    assert integrity.replaced() is None


def test_draws_read_the_entropy_bound_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """A constant os.urandom put in after import steers no draw (and is named as replaced)."""
    integrity.seal()
    monkeypatch.setattr(os, "urandom", lambda count: bytes(count))
    assert len({draw(1000) for _ in range(20)}) > 1
    assert integrity.replaced() == "os.urandom"


def test_a_clock_replaced_before_the_seal_is_found_by_the_binding_at_import() -> None:
    """A clock replaced before anything was sealed (a plugin imported in a process that seals
    later) is sealed as replaced: only the clocks timing.py bound at import still name it."""
    code = ("import time\n"
            "from fusionlab.measure import integrity, timing\n"
            "time.perf_counter = lambda: 0.0\n"
            "integrity.seal()\n"
            "print(integrity.replaced())\n"
            "print(timing.clock_tampering())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "None", "time.perf_counter was replaced in the measuring process"]


def test_draws_cover_the_range_evenly() -> None:
    counts = [0] * 3
    for _ in range(3000):
        counts[draw(3)] += 1
    assert all(800 < count < 1200 for count in counts), counts

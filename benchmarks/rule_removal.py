"""Each rule of the gate taken out, one at a time: its own end-to-end test must fail.

A targeted complement to benchmarks/mutation.py (which mutates everything, slowly): for every
rule below, a scratch copy of the checkout gets that one rule disabled (an exact edit of the
source), and the rule's tests run against the copy (PYTHONPATH points at it, so the copy is what
the tests and the measuring workers import). "caught" means the tests failed, as they must;
"SURVIVED" means nothing noticed the rule was gone; "skipped" means the test could not judge.
First the same tests run on the unchanged copy, which must pass. Exit code 1 unless every rule
is caught.

    python benchmarks/rule_removal.py            # every rule (about 2 minutes here)
    python benchmarks/rule_removal.py --list     # the rules and their tests
    python benchmarks/rule_removal.py alias refill
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mutation import copy_checkout  # benchmarks/mutation.py, beside this script
from tabulate import tabulate

RULES_TESTS = "tests/test_gate_rules.py::"
ROUND3_TESTS = "tests/test_gate_round3.py::"
CHEAT = ROUND3_TESTS + "test_round_three_cheat_is_caught_and_never_wins"
ROUND4_TESTS = "tests/test_gate_round4.py::"
CHEAT4 = ROUND4_TESTS + "test_round_four_cheat_is_caught_with_the_rule_named"
ROUND5_TESTS = "tests/test_gate_round5.py::"
CHEAT5 = ROUND5_TESTS + "test_round_five_cheat_is_caught_with_the_rule_named"
DISPATCHER5 = (ROUND5_TESTS + "test_a_kernel_registered_over_an_aten_op_is_caught_and_retires_the"
               "_worker")


@dataclass(frozen=True)
class Removal:
    """One rule, the exact edit that disables it, and the tests that must then fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


REMOVALS = (
    Removal("error bound", "fusionlab/measure/correctness.py",
            "if bool((error > bound).any()):", "if False:",
            (RULES_TESTS + "test_wrong_values_are_incorrect",)),
    Removal("plain dense tensors only", "fusionlab/measure/correctness.py",
            "if type(out) is not torch.Tensor or out.layout is not torch.strided:", "if False:",
            (CHEAT + "[outputs computed only when read-r3-lazy-subclass-statuses0]",)),
    Removal("alias of an input", "fusionlab/measure/correctness.py",
            "if isinstance(tensor, torch.Tensor) and shares_memory(out, tensor):", "if False:",
            (RULES_TESTS + "test_an_output_that_is_the_unchanged_input_is_reused_memory",)),
    Removal("outputs still held by the variant", "fusionlab/measure/correctness.py",
            "if extra_refs > 0 or base_refs > 0 or holders > 2 + has_base:", "if False:",
            (ROUND3_TESTS + "test_outputs_still_held_by_the_variant_are_caught_at_large_"
             "shapes_too",)),
    Removal("undeclared input mutation (first call)", "fusionlab/measure/correctness.py",
            "if name not in declared and not torch.equal(tensor, copy):", "if False:",
            (RULES_TESTS + "test_a_first_call_that_changes_an_undeclared_input_is_incorrect",)),
    Removal("input sets checksummed", "fusionlab/measure/trial.py",
            "    if modified:\n", "    if False:\n",
            (RULES_TESTS + "test_input_sets_changed_by_later_calls_with_right_outputs_are_"
             "incorrect",)),
    Removal("refill (the answer follows new values)", "fusionlab/measure/trial.py",
            "    target = m.sets.sets[0]\n    saved = _copy_outputs(target)\n",
            "    return\n    target = m.sets.sets[0]\n    saved = _copy_outputs(target)\n",
            (RULES_TESTS + "test_a_result_cached_by_input_address_is_stale",)),
    Removal("refill of one value far from the start", "fusionlab/measure/trial.py",
            "if flat is not None and flat.numel() > 1:", "if False:",
            (RULES_TESTS + "test_a_result_cached_by_its_first_values_is_stale_after_one_far_"
             "value_changes",)),
    Removal("stale only when it is the old answer", "fusionlab/measure/trial.py",
            "if _answers(m, outputs, before):", "if True:",
            (RULES_TESTS + "test_a_wrong_answer_after_an_in_place_change_that_is_not_the_old_one"
             "_is_incorrect",)),
    Removal("copy-bandwidth limit", "fusionlab/measure/trial.py",
            "        if reason:\n            raise GateFailure(Status.SUSPICIOUS,",
            "        if False:\n            raise GateFailure(Status.SUSPICIOUS,",
            (RULES_TESTS + "test_bandwidth_beyond_a_quiet_copy_limit_is_suspicious_on_a_busy_"
             "machine_too",)),
    Removal("a busy copy limit: the last quiet one judges, else unjudged",
            "fusionlab/measure/trial.py",
            "if reason and disturbance.BUSY_NOTE in limit.note:", "if False:",
            (RULES_TESTS + "test_a_copy_limit_that_stays_busy_is_replaced_by_the_last_quiet_one",
             RULES_TESTS + "test_a_copy_limit_measured_while_busy_with_no_quiet_one_stored_leaves"
             "_it_unjudged")),
    Removal("copy measured again before a verdict", "fusionlab/measure/trial.py",
            "for _ in range(_REMEASURES if reason else 0):", "for _ in range(0):",
            (RULES_TESTS + "test_the_copy_is_measured_again_before_a_suspicious_verdict",)),
    Removal("zero device ops", "fusionlab/measure/trial.py",
            "if fusion.device_ops == 0:", "if False:",
            (RULES_TESTS + "test_work_the_profiler_cannot_see_is_suspicious",)),
    Removal("device work proportional to the op", "fusionlab/measure/trial.py",
            "if seen < needed:", "if False:",
            (CHEAT + "[a token device op-r3-token-add-statuses15]",)),
    Removal("replaced clocks", "fusionlab/measure/timing.py",
            "        if getattr(time, name) is not original:", "        if False:",
            (CHEAT + "[replacing the clock-r3-clock-perf-counter-statuses7]",)),
    Removal("draws read the entropy bound at import", "fusionlab/measure/timing.py",
            "int.from_bytes(_urandom(8), \"little\")",
            "int.from_bytes(__import__(\"os\").urandom(8), \"little\")",
            (ROUND4_TESTS + "test_draws_read_the_entropy_bound_at_import",)),
    Removal("nothing the measuring path uses replaced", "fusionlab/measure/timing.py",
            "    if name is not None:\n", "    if False:\n",
            (CHEAT4 + "[tampered entropy-r4-entropy-os-urandom-statuses0-os.urandom]",
             CHEAT4 + "[sabotaged competitors-r4-slow-down-builtin-statuses11-torch.rms_norm]")),
    Removal("audit hook: events while measured", "fusionlab/measure/events.py",
            "        if state.watching:\n", "        if False:\n",
            (CHEAT4 + "[what the audit hook sees-r4-getframe-statuses5-sys._getframe]",)),
    Removal("audit hook: code of fusionlab's functions swapped", "fusionlab/measure/events.py",
            "elif event in _SETATTR and _is_ours(args[0]):", "elif False:",
            (CHEAT4 + "[red team-r4-swap-code-of-gate-statuses14-__code__]",)),
    Removal("a profile function installed", "fusionlab/measure/events.py",
            "if sys.getprofile() is not profile:", "if False:",
            (CHEAT4 + "[what the audit hook sees-r4-setprofile-at-build-statuses4-profile]",)),
    Removal("new Python threads while measured", "fusionlab/measure/events.py",
            "for thread in set(threading.enumerate()) - threads]", "for thread in ()]",
            (CHEAT4 + "[what the audit hook sees-r4-thread-left-running-statuses7-thread]",)),
    Removal("new child processes while measured", "fusionlab/measure/events.py",
            "for pid in _children() - children]", "for pid in ()]",
            (CHEAT4 + "[what the audit hook sees-r4-child-burner-silent-spawn-statuses9-a child "
             "process started]",)),
    Removal("torch's thread count after each sample", "fusionlab/measure/timing.py",
            "if threads and _torch_threads() != threads:", "if False:",
            (CHEAT4 + "[more threads than the cell-r4-threads-left-raised-statuses10-thread "
             "count was not the cell's]",)),
    Removal("CPU time within the cell's threads", "fusionlab/measure/timing.py",
            "if self.cpu_s <= allowed:", "if True:",
            (ROUND4_TESTS + "test_cpu_time_beyond_the_cells_threads_is_suspicious",)),
    Removal("samples look alike: the checked call drawn after the sample, among all its calls",
            "fusionlab/measure/timing.py",
            "index, before, outputs = made[at]", "index, before, outputs = made[0]",
            (ROUND4_TESTS + "test_an_in_place_loop_checks_calls_at_any_place_in_a_sample",
             CHEAT4 + "[samples that do not look alike-r4-honest-after-a-pause-statuses16-in "
             "timed call]")),
    Removal("untimed gaps: CPU time beyond the harness's own", "fusionlab/measure/timing.py",
            "        if spent <= allowed:\n", "        if True:\n",
            (CHEAT4 + "[work in the untimed gaps-r4-work-in-finalizer-statuses17-of CPU time ran "
             "in the]",
             ROUND4_TESTS + "test_untimed_gaps_are_judged_by_the_harnesss_own_measured_cost")),
    Removal("audited much slower: inconsistent", "fusionlab/measure/audit.py",
            "if decided_ms and timing.min_ms > INCONSISTENT_RATIO * decided_ms:", "if False:",
            (ROUND3_TESTS + "test_an_audited_latency_much_slower_than_the_decided_one_is_"
             "inconsistent",)),
    Removal("sealed dispatcher tables", "fusionlab/measure/integrity.py",
            "        if _TABLES.get(name) != table:", "        if False:",
            (DISPATCHER5 + "[r5-aten-compare-always-within]",
             DISPATCHER5 + "[r5-aten-slow-builtin]")),
    Removal("input checksum with secret per-position weights", "fusionlab/measure/inputs.py",
            "weighted = torch.mul(flat, _weights(flat.numel()))", "weighted = flat",
            (CHEAT5 + "[r5-ulp-tagged-cache-expected2]",)),
    Removal("refill probe inside the timing loop", "fusionlab/measure/timing.py",
            "probe.alter(position % sets)", "pass",
            (CHEAT5 + "[r5-sampled-key-cache-expected1]",)),
    Removal("an audit disturbed in every attempt: unjudged", "fusionlab/measure/audit.py",
            "        if busy:\n", "        if False:\n",
            (ROUND5_TESTS + "test_an_audit_disturbed_in_every_attempt_leaves_an_honest_contender"
             "_unjudged",)),
    Removal("a contender that fails its re-measurement is recorded failed", "search/runner.py",
            "        if dropped:", "        if False:",
            (ROUND3_TESTS + "test_a_contender_that_fails_its_re_measurement_never_wins_and_"
             "shows_why",)),
)


def _pytest(scratch: Path, tests: tuple[str, ...]) -> tuple[str, float]:
    """pytest's outcome: `passed`, `failed`, `skipped` (nothing judged: e.g. a copy limit
    measured while the machine was busy) or `error N` (pytest's exit code)."""
    env = {**os.environ, "PYTHONPATH": str(scratch)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=scratch, env=env, capture_output=True, text=True, check=False,
    )
    seconds = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines and "passed" not in lines[-1]:
        return "skipped", seconds
    return {0: "passed", 1: "failed"}.get(done.returncode, f"error {done.returncode}"), seconds


def _without(scratch: Path, removal: Removal) -> tuple[str, float]:
    """Run the removal's tests with its rule disabled in the copy; the copy is restored after."""
    path = scratch / removal.path
    source = path.read_text()
    if source.count(removal.old) != 1:
        return "edit not found (update this script)", 0.0
    path.write_text(source.replace(removal.old, removal.new))
    try:
        outcome, seconds = _pytest(scratch, removal.tests)
    finally:
        path.write_text(source)
    shown = {"failed": "caught", "passed": "SURVIVED", "skipped": "skipped (run it again)"}
    return shown.get(outcome, outcome), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="words of rule names to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the rules and their tests")
    args = parser.parse_args()
    chosen = [r for r in REMOVALS if not args.names or any(w in r.name for w in args.names)]
    if args.list:
        print(tabulate([(r.name, r.path, "\n".join(r.tests)) for r in chosen],
                       headers=["rule", "in", "tests"]))
        return
    scratch = Path(tempfile.mkdtemp(prefix="fusionlab-rule-removal-"))
    try:
        copy_checkout(scratch)
        every_test = tuple(dict.fromkeys(t for r in chosen for t in r.tests))
        outcome, seconds = _pytest(scratch, every_test)
        print(f"baseline: {len(every_test)} tests on the unchanged copy: {outcome} "
              f"({seconds:.0f} s)", flush=True)
        if outcome != "passed":
            sys.exit(1)
        rows = []
        for removal in chosen:
            outcome, seconds = _without(scratch, removal)
            rows.append((removal.name, outcome, f"{seconds:.0f}", removal.tests[0].split("::")[1]))
            print(f"{removal.name}: {outcome}", flush=True)
        print(tabulate(rows, headers=["rule removed", "its tests", "s", "test"]))
        caught = sum(row[1] == "caught" for row in rows)
        print(f"{caught} of {len(rows)} rules: taking the rule out makes its test fail")
        sys.exit(0 if caught == len(rows) else 1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

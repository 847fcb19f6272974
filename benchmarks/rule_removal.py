"""Each rule of the gate taken out, one at a time: its own end-to-end test must fail.

A targeted complement to benchmarks/mutation.py (which mutates everything, slowly): for every
rule of fusionlab/measure/rules.py the rule's tests run with that one rule switched off by name
(FUSIONLAB_DISABLE_RULES, read once when the measuring modules are imported), against a scratch
copy of the checkout (PYTHONPATH points at it, so the copy is what the tests and the measuring
workers import). A rule that is not a check the measuring path can skip (`switchable` False) and
the one rule outside fusionlab/measure are taken out by an exact edit of the copy's source
instead. "caught" means the tests failed, as they must; "SURVIVED" means nothing noticed the rule
was gone; "skipped" means the test could not judge. First the same tests run with every rule on,
which must pass. Exit code 1 unless every rule is caught.

    python benchmarks/rule_removal.py            # every rule (a few minutes)
    python benchmarks/rule_removal.py --list     # the rules: what each checks, status, where, tests
    python benchmarks/rule_removal.py refill error_bound
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

from fusionlab.measure.rules import ENVIRONMENT, RULES

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
class Edit:
    """An exact edit of one file that takes out a rule no name switches off."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Removal:
    """One rule (by its name in fusionlab/measure/rules.py, or `outside` saying what it checks
    for one outside fusionlab/measure), the tests that must fail without it, and the edit that
    takes it out when no name switches it off."""

    name: str
    tests: tuple[str, ...]
    edit: Edit | None = None
    outside: str = ""

    def described(self) -> tuple[str, str, str]:
        """What the rule checks, the status it gives, where it runs."""
        if self.outside:
            return self.outside, "the failed check's", f"rounds ({self.edit and self.edit.path})"
        rule = RULES[self.name]
        return rule.checks, rule.status.value, rule.where


REMOVALS = (
    Removal("error_bound", (RULES_TESTS + "test_wrong_values_are_incorrect",)),
    Removal("plain_dense_outputs",
            (CHEAT + "[outputs computed only when read-r3-lazy-subclass-statuses0]",)),
    Removal("no_input_alias",
            (RULES_TESTS + "test_an_output_that_is_the_unchanged_input_is_reused_memory",)),
    Removal("not_retained",
            (ROUND3_TESTS + "test_outputs_still_held_by_the_variant_are_caught_at_large_"
             "shapes_too",)),
    Removal("undeclared_mutation",
            (RULES_TESTS + "test_a_first_call_that_changes_an_undeclared_input_is_incorrect",)),
    Removal("sets_checksummed",
            (RULES_TESTS + "test_input_sets_changed_by_later_calls_with_right_outputs_are_"
             "incorrect",)),
    Removal("refill", (RULES_TESTS + "test_a_result_cached_by_input_address_is_stale",)),
    Removal("refill_far_value",
            (RULES_TESTS + "test_a_result_cached_by_its_first_values_is_stale_after_one_far_"
             "value_changes",)),
    Removal("stale_only_old_answer",
            (RULES_TESTS + "test_a_wrong_answer_after_an_in_place_change_that_is_not_the_old_one"
             "_is_incorrect",)),
    Removal("copy_bandwidth",
            (RULES_TESTS + "test_bandwidth_beyond_a_quiet_copy_limit_is_suspicious_on_a_busy_"
             "machine_too",)),
    Removal("busy_copy_limit",
            (RULES_TESTS + "test_a_copy_limit_that_stays_busy_is_replaced_by_the_last_quiet_one",
             RULES_TESTS + "test_a_copy_limit_measured_while_busy_with_no_quiet_one_stored_leaves"
             "_it_unjudged")),
    Removal("copy_remeasured",
            (RULES_TESTS + "test_the_copy_is_measured_again_before_a_suspicious_verdict",)),
    Removal("device_ops", (RULES_TESTS + "test_work_the_profiler_cannot_see_is_suspicious",)),
    Removal("device_work", (CHEAT + "[a token device op-r3-token-add-statuses15]",)),
    Removal("replaced_clocks",
            (ROUND4_TESTS + "test_a_clock_replaced_before_the_seal_is_found_by_the_binding_at_"
             "import", CHEAT + "[replacing the clock-r3-clock-perf-counter-statuses7]")),
    Removal("entropy_bound", (ROUND4_TESTS + "test_draws_read_the_entropy_bound_at_import",),
            Edit("fusionlab/measure/timing.py", "int.from_bytes(_urandom(8), \"little\")",
                 "int.from_bytes(__import__(\"os\").urandom(8), \"little\")")),
    Removal("nothing_replaced",
            (CHEAT4 + "[tampered entropy-r4-entropy-os-urandom-statuses0-os.urandom]",
             CHEAT4 + "[sabotaged competitors-r4-slow-down-builtin-statuses11-torch.rms_norm]")),
    Removal("audit_events",
            (CHEAT4 + "[what the audit hook sees-r4-getframe-statuses5-sys._getframe]",)),
    Removal("code_swapped", (CHEAT4 + "[red team-r4-swap-code-of-gate-statuses14-__code__]",)),
    Removal("profile_function",
            (CHEAT4 + "[what the audit hook sees-r4-setprofile-at-build-statuses4-profile]",)),
    Removal("new_threads",
            (CHEAT4 + "[what the audit hook sees-r4-thread-left-running-statuses7-thread]",)),
    Removal("new_children",
            (CHEAT4 + "[what the audit hook sees-r4-child-burner-silent-spawn-statuses9-a child "
             "process started]",)),
    Removal("thread_count",
            (CHEAT4 + "[more threads than the cell-r4-threads-left-raised-statuses10-thread "
             "count was not the cell's]",)),
    Removal("cpu_time",
            (ROUND4_TESTS + "test_cpu_time_beyond_the_cells_threads_is_suspicious",)),
    Removal("samples_alike",
            (ROUND4_TESTS + "test_an_in_place_loop_checks_calls_at_any_place_in_a_sample",
             CHEAT4 + "[samples that do not look alike-r4-honest-after-a-pause-statuses16-in "
             "timed call]")),
    Removal("untimed_gaps",
            (CHEAT4 + "[work in the untimed gaps-r4-work-in-finalizer-statuses17-of CPU time ran "
             "in the]",
             ROUND4_TESTS + "test_untimed_gaps_are_judged_by_the_harnesss_own_measured_cost")),
    Removal("audit_inconsistent",
            (ROUND3_TESTS + "test_an_audited_latency_much_slower_than_the_decided_one_is_"
             "inconsistent",)),
    Removal("sealed_dispatcher",
            (DISPATCHER5 + "[r5-aten-compare-always-within]",
             DISPATCHER5 + "[r5-aten-slow-builtin]")),
    Removal("weighted_checksum", (CHEAT5 + "[r5-ulp-tagged-cache-expected2]",)),
    Removal("refill_probe", (CHEAT5 + "[r5-sampled-key-cache-expected1]",)),
    Removal("audit_disturbed",
            (ROUND5_TESTS + "test_an_audit_disturbed_in_every_attempt_leaves_an_honest_contender"
             "_unjudged",)),
    Removal("failed_remeasurement_recorded",
            (ROUND3_TESTS + "test_a_contender_that_fails_its_re_measurement_never_wins_and_"
             "shows_why",),
            Edit("search/runner.py", "        if dropped:", "        if False:"),
            "a contender that fails its re-measurement is recorded failed, the cell decided "
            "without it"),
)


def _pytest(scratch: Path, tests: tuple[str, ...], disabled: str = "") -> tuple[str, float]:
    """pytest's outcome with the rules named in `disabled` switched off: `passed`, `failed`,
    `skipped` (nothing judged: e.g. a copy limit measured while the machine was busy) or
    `error N` (pytest's exit code)."""
    env = {**os.environ, "PYTHONPATH": str(scratch), ENVIRONMENT: disabled}
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


def _edited(scratch: Path, removal: Removal) -> tuple[str, float]:
    """Run the removal's tests with its edit made in the copy; the copy is restored after."""
    edit = removal.edit
    assert edit is not None
    path = scratch / edit.path
    source = path.read_text()
    if source.count(edit.old) != 1:
        return "edit not found (update this script)", 0.0
    path.write_text(source.replace(edit.old, edit.new))
    try:
        return _pytest(scratch, removal.tests)
    finally:
        path.write_text(source)


def _without(scratch: Path, removal: Removal) -> tuple[str, float]:
    """Run the removal's tests with its rule taken out: switched off by name, else edited."""
    if removal.edit is not None:
        outcome, seconds = _edited(scratch, removal)
    else:
        outcome, seconds = _pytest(scratch, removal.tests, removal.name)
    shown = {"failed": "caught", "passed": "SURVIVED", "skipped": "skipped (run it again)"}
    return shown.get(outcome, outcome), seconds


def _unlisted() -> list[str]:
    """Rules of the registry no removal takes out (each must have its test here), and rules no
    name switches off that have no edit here."""
    edited = {removal.name for removal in REMOVALS if removal.edit is not None}
    listed = {removal.name for removal in REMOVALS if removal.edit is None} | edited
    return [name for name, rule in RULES.items()
            if name not in listed or (not rule.switchable and name not in edited)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="words of rule names to run (default: all)")
    parser.add_argument("--list", action="store_true",
                        help="print the rules: what each checks, its status, where, its tests")
    args = parser.parse_args()
    if _unlisted():
        sys.exit(f"rules with no removal here: {', '.join(_unlisted())}; add each with its test")
    chosen = [r for r in REMOVALS if not args.names or any(w in r.name for w in args.names)]
    if args.list:
        rows = [(r.name, *r.described(), "by name" if r.edit is None else f"edit of {r.edit.path}",
                 "\n".join(t.split("::")[1] for t in r.tests)) for r in chosen]
        print(tabulate(rows, headers=["rule", "checks", "status", "where", "off", "tests"]))
        return
    scratch = Path(tempfile.mkdtemp(prefix="fusionlab-rule-removal-"))
    try:
        copy_checkout(scratch)
        every_test = tuple(dict.fromkeys(t for r in chosen for t in r.tests))
        outcome, seconds = _pytest(scratch, every_test)
        print(f"baseline: {len(every_test)} tests with every rule on: {outcome} "
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

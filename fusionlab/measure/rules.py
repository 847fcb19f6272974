"""Every rule of the gate as one named object: what it checks, the status it gives, where it runs.

A check in the measuring path asks its rule whether it applies (`on(name)`); `RULES` lists
them all, and benchmarks/rule_removal.py switches each off by name to show its test then fails.

Switching rules off is a test and benchmark hook only: `FUSIONLAB_DISABLE_RULES=name,name` is
read once, when this module is first imported. The measuring worker imports it before any
plugin loads and starts with the value its parent read at import (measure/worker.py), so a
plugin that sets the variable later switches nothing off, here or in a worker. A sweep with a
rule off prints one warning line (`warn_if_disabled`): figures measured so are not to be shipped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType

from fusionlab.records import Status

ENVIRONMENT = "FUSIONLAB_DISABLE_RULES"
_READ_AT_IMPORT = os.environ.get(ENVIRONMENT, "")
_DISABLED = frozenset(name.strip() for name in _READ_AT_IMPORT.split(",") if name.strip())

FIRST_CALL = "first call"
LOOP = "loop"
REFILL = "refill"
LIMITS = "copy limits"
PROFILER = "profiler"
AUDIT = "audit"
WORKER = "worker"


@dataclass(frozen=True)
class Rule:
    """One rule of the gate: its name, what it checks (one line), the status a trial that breaks
    it gets, and where it runs (first call, loop, refill, copy limits, profiler, audit, worker;
    several joined by ", "). `enabled` is False only when switched off by ENVIRONMENT; a rule
    that is how the harness is built, not a check (`switchable` False), is never switched off."""

    name: str
    checks: str
    status: Status
    where: str
    switchable: bool = True
    enabled: bool = True


_INVENTORY = (
    Rule("error_bound", "every output within atol + rtol*|ref| of its float64 reference",
         Status.INCORRECT, f"{FIRST_CALL}, {LOOP}, {REFILL}, {AUDIT}"),
    Rule("plain_dense_outputs", "outputs are plain dense torch.Tensor (no lazy subclass)",
         Status.INCORRECT, f"{FIRST_CALL}, {LOOP}, {AUDIT}"),
    Rule("no_input_alias", "an output not declared in place shares no memory with an input",
         Status.REUSED_MEMORY, f"{FIRST_CALL}, {LOOP}"),
    Rule("not_retained", "the variant holds no reference to an output it returned",
         Status.REUSED_MEMORY, f"{LOOP}, {AUDIT}"),
    Rule("undeclared_mutation", "the first call writes no input it does not declare in place",
         Status.INCORRECT, FIRST_CALL),
    Rule("sets_checksummed", "every input set unchanged before and after the timing loop",
         Status.INCORRECT, LOOP),
    Rule("refill", "new values written into the same tensors (all, then one far value): the "
         "answer follows",
         Status.STALE_RESULT, REFILL),
    Rule("refill_far_value", "after one value far from the start changes the answer follows",
         Status.STALE_RESULT, REFILL),
    Rule("stale_only_old_answer", "a wrong answer after a refill is stale only when it is the "
         "old values' answer (else incorrect)", Status.INCORRECT, REFILL),
    Rule("copy_bandwidth", "no latency moves the op's bytes faster than the device copies them",
         Status.SUSPICIOUS, LIMITS),
    Rule("busy_copy_limit", "a copy limit that stays busy: the last quiet one judges, else "
         "unjudged", Status.UNJUDGED, LIMITS),
    Rule("copy_remeasured", "the copy limit is measured again before a suspicious verdict",
         Status.SUSPICIOUS, LIMITS),
    Rule("device_ops", "the profiler sees device ops in a call", Status.SUSPICIOUS, PROFILER),
    Rule("device_work", "the operators seen take at least the op's input elements per call",
         Status.SUSPICIOUS, PROFILER),
    Rule("replaced_clocks", "no clock of the time module replaced", Status.SUSPICIOUS, LOOP),
    Rule("nothing_replaced", "nothing the measuring path uses replaced since the seal",
         Status.SUSPICIOUS, LOOP),
    Rule("audit_events", "no audited event (tracers, frames, ctypes, processes) while measured",
         Status.SUSPICIOUS, LOOP),
    Rule("code_swapped", "the code of fusionlab's own functions never replaced",
         Status.SUSPICIOUS, f"{LOOP}, {WORKER}"),
    Rule("profile_function", "no profile or trace function installed after the hook",
         Status.SUSPICIOUS, f"{LOOP}, {WORKER}"),
    Rule("new_threads", "no Python thread started and left running while measured",
         Status.SUSPICIOUS, LOOP),
    Rule("new_children", "no child process started and left running while measured",
         Status.SUSPICIOUS, LOOP),
    Rule("thread_count", "torch's thread count is the cell's after every sample",
         Status.SUSPICIOUS, LOOP),
    Rule("entropy_bound", "draws read os.urandom as bound at import (a replaced one steers none)",
         Status.SUSPICIOUS, LOOP, switchable=False),
    Rule("samples_alike", "the checked call is drawn after the sample, among all its calls",
         Status.INCORRECT, LOOP),
    Rule("cpu_time", "the loop's CPU time fits the cell's threads", Status.SUSPICIOUS, LOOP),
    Rule("untimed_gaps", "CPU time in the untimed gaps fits the harness's own measured cost",
         Status.SUSPICIOUS, LOOP),
    Rule("refill_probe", "one value changed between two samples inside the timing loop: the "
         "next call follows it", Status.STALE_RESULT, LOOP),
    Rule("sealed_dispatcher", "the kernel tables of the ATen ops the gate uses are as sealed",
         Status.SUSPICIOUS, f"{LOOP}, {WORKER}"),
    Rule("weighted_checksum", "input checksums weight every position by a secret weight",
         Status.INCORRECT, LOOP),
    Rule("audit_inconsistent", "an audited latency is not much slower than the decided one",
         Status.INCONSISTENT, AUDIT),
    Rule("audit_disturbed", "an audit disturbed in every attempt is unjudged, not accused",
         Status.UNJUDGED, AUDIT),
)

RULES: MappingProxyType[str, Rule] = MappingProxyType({
    rule.name: replace(rule, enabled=not rule.switchable or rule.name not in _DISABLED)
    for rule in _INVENTORY
})
"""Every rule of the gate by name (read-only)."""


def on(name: str, rules: Mapping[str, Rule] = RULES) -> bool:
    """Whether the rule `name` applies (a KeyError for a name no rule has). The registry is
    bound as a default: rebinding `RULES` changes nothing, and replacing the default is seen
    by the audit hook (measure/events.py)."""
    return rules[name].enabled


def warning() -> str | None:
    """One line saying which rules are switched off, or None when all apply."""
    if not _DISABLED:
        return None
    off = sorted(name for name in _DISABLED if name in RULES and not RULES[name].enabled)
    ignored = sorted(name for name in _DISABLED if name not in off)
    text = (f"warning: gate rules switched off by {ENVIRONMENT} (a test hook): "
            f"{', '.join(off) or 'none'}; figures measured so must not be shipped")
    if ignored:
        text += f" (ignored, no rule of that name can be switched off: {', '.join(ignored)})"
    return text


_WARNED: list[bool] = []


def warn_if_disabled() -> None:
    """Print `warning()` to stderr, once per process."""
    text = warning()
    if text and not _WARNED:
        _WARNED.append(True)
        print(text, file=sys.stderr, flush=True)


@contextmanager
def inherited() -> Iterator[None]:
    """os.environ holds ENVIRONMENT as read at import while a worker process is started inside
    the block (a plugin that set it since changes nothing there); restored after."""
    saved = os.environ.get(ENVIRONMENT)
    if _READ_AT_IMPORT:
        os.environ[ENVIRONMENT] = _READ_AT_IMPORT
    else:
        os.environ.pop(ENVIRONMENT, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENVIRONMENT, None)
        else:
            os.environ[ENVIRONMENT] = saved

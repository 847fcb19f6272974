"""Round-four adversarial RMSNorm variants: each attacks the measuring process itself (the gate's
round-four classes, and this round's own red team). Every one must earn a status with a one-line
reason that names the rule, and never win.

Nothing here leaves anything running: a child process burns CPU for two seconds and exits.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import random
import subprocess
import sys
import threading
import time
import weakref
from collections import deque

import torch

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

CPU = ("cpu",)

# class -> (variant, the statuses it may earn, a word the message must hold).
EXPECTED: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    "tampered entropy": [
        ("r4-entropy-os-urandom", ("suspicious",), "os.urandom"),
        ("r4-entropy-bound-name", ("suspicious",), "_urandom"),
        ("r4-entropy-draw", ("suspicious",), "draw"),
    ],
    "what the audit hook sees": [
        ("r4-setprofile-in-call", ("suspicious",), "setprofile"),
        ("r4-setprofile-at-build", ("suspicious",), "profile"),
        ("r4-getframe", ("suspicious",), "sys._getframe"),
        ("r4-ctypes-view", ("suspicious",), "ctypes.cdata"),
        ("r4-thread-left-running", ("suspicious",), "thread"),
        ("r4-child-burner", ("suspicious",), "subprocess.Popen"),
        ("r4-child-burner-silent-spawn", ("suspicious",), "a child process started"),
    ],
    "more threads than the cell": [
        ("r4-threads-left-raised", ("suspicious",), "thread count was not the cell's"),
    ],
    "sabotaged competitors": [
        ("r4-slow-down-builtin", ("suspicious",), "torch.rms_norm"),
    ],
    "red team": [
        ("r4-replace-check-values", ("suspicious",), "check_values"),
        ("r4-gc-find-kept", ("suspicious",), "gc.get_"),
        ("r4-swap-code-of-gate", ("suspicious",), "__code__"),
        # Not seen by the hook (a ctypes call on integer addresses raises no audit event);
        # caught by the refill rule instead.
        ("r4-ctypes-memmove", ("stale_result",), "old values"),
    ],
    "samples that do not look alike": [
        ("r4-honest-after-a-pause", ("incorrect",), "in timed call"),
    ],
    "work in the untimed gaps": [
        ("r4-work-in-finalizer", ("suspicious",), "of CPU time ran in the"),
    ],
}

# --- tampered entropy -------------------------------------------------------------------------


@register_variant("rmsnorm", "r4-entropy-os-urandom", devices=CPU)
def entropy_os_urandom(device_type: str):
    """Replaces os.urandom (and random's reference to it) with a seeded generator: every draw of
    the harness through them becomes predictable."""
    fake = random.Random(0).randbytes
    os.urandom = fake
    random._urandom = fake  # type: ignore[attr-defined]
    return naive_rmsnorm


@register_variant("rmsnorm", "r4-entropy-bound-name", devices=CPU)
def entropy_bound_name(device_type: str):
    """Replaces the entropy source the timing module bound at import."""
    timing = sys.modules["fusionlab.measure.timing"]
    timing._urandom = random.Random(0).randbytes  # type: ignore[attr-defined]
    return naive_rmsnorm


@register_variant("rmsnorm", "r4-entropy-draw", devices=CPU)
def entropy_draw(device_type: str):
    """Makes the timing loop's draws land past the checked ones (nothing in a loop is ever
    checked), then hands back an answer cached by input address."""
    timing = sys.modules["fusionlab.measure.timing"]
    timing.draw = lambda count: count - 1  # type: ignore[attr-defined]
    cache: dict[int, torch.Tensor] = {}

    def kernel(x, weight, eps):
        if x.data_ptr() not in cache:
            cache[x.data_ptr()] = naive_rmsnorm(x, weight, eps)
        return cache[x.data_ptr()].clone()

    return kernel


# --- what the audit hook sees -----------------------------------------------------------------


def _gap_worker():
    """A profile function that computes answers between the timed calls (in the harness's own
    calls, outside every timed window) for the kernel to hand out during them."""
    ready: dict[int, torch.Tensor] = {}
    seen: dict[int, tuple] = {}
    busy = [False]

    def profile(frame, event, arg):
        if busy[0] or event != "call":
            return
        busy[0] = True
        try:
            for key, args in seen.items():
                if key not in ready:
                    ready[key] = naive_rmsnorm(*args)
        finally:
            busy[0] = False

    def kernel(x, weight, eps):
        busy[0] = True
        try:
            seen[x.data_ptr()] = (x, weight, eps)
            out = ready.pop(x.data_ptr(), None)
            return out if out is not None else naive_rmsnorm(x, weight, eps)
        finally:
            busy[0] = False

    return profile, kernel


@register_variant("rmsnorm", "r4-setprofile-in-call", devices=CPU)
def setprofile_in_call(device_type: str):
    """Installs its gap worker from inside a call (after the first)."""
    profile, compute = _gap_worker()
    calls = itertools.count()

    def kernel(x, weight, eps):
        if next(calls) == 2:
            sys.setprofile(profile)
        return compute(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "r4-setprofile-at-build", devices=CPU)
def setprofile_at_build(device_type: str):
    """Installs its gap worker when it is built, before any timing loop watches."""
    profile, kernel = _gap_worker()
    sys.setprofile(profile)
    return kernel


@register_variant("rmsnorm", "r4-getframe", devices=CPU)
def getframe(device_type: str):
    """Walks up the stack reading the harness's locals (to learn the sample it is in)."""

    def kernel(x, weight, eps):
        frame = sys._getframe(1)
        while frame is not None and "position" not in frame.f_locals:
            frame = frame.f_back
        return naive_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "r4-ctypes-memmove", devices=CPU)
def ctypes_memmove(device_type: str):
    """Copies a cached answer into a fresh output with ctypes.memmove: no torch op sees it."""
    cache: dict[int, torch.Tensor] = {}

    def kernel(x, weight, eps):
        if x.data_ptr() not in cache:
            cache[x.data_ptr()] = naive_rmsnorm(x, weight, eps)
        source = cache[x.data_ptr()]
        out = torch.empty_like(source)
        size = source.numel() * source.element_size()
        ctypes.memmove(out.data_ptr(), source.data_ptr(), size)
        return out

    return kernel


@register_variant("rmsnorm", "r4-ctypes-view", devices=CPU)
def ctypes_view(device_type: str):
    """Reads its inputs through a ctypes view of their memory (to fingerprint them unseen)."""

    def kernel(x, weight, eps):
        view = (ctypes.c_char * 8).from_address(x.data_ptr())
        bytes(view)
        return naive_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "r4-thread-left-running", devices=CPU)
def thread_left_running(device_type: str):
    """Starts a helper thread during the timed calls that stays alive (to precompute later)."""
    calls = itertools.count()
    stop = threading.Event()

    def kernel(x, weight, eps):
        if next(calls) == 2:
            threading.Thread(target=stop.wait, args=(5.0,), daemon=True).start()
        return naive_rmsnorm(x, weight, eps)

    return kernel


_BURN = "import time\nend = time.time() + 2\nwhile time.time() < end:\n    pass\n"


@register_variant("rmsnorm", "r4-child-burner", devices=CPU)
def child_burner(device_type: str):
    """Starts a CPU-burning child process from a timed call, so the copy limits measured next
    are noted busy (and judged nothing, before this round)."""
    calls = itertools.count()

    def kernel(x, weight, eps):
        if next(calls) == 2:
            subprocess.Popen([sys.executable, "-c", _BURN])
        return naive_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "r4-child-burner-silent-spawn", devices=CPU)
def child_burner_silent_spawn(device_type: str):
    """As above, through libc's posix_spawn resolved at build time: no audit event is raised
    when it is called, only the child is there to see."""
    spawn = ctypes.CDLL(None).posix_spawn
    calls = itertools.count()

    def kernel(x, weight, eps):
        if next(calls) == 2:
            pid = ctypes.c_int()
            argv = (ctypes.c_char_p * 6)(b"timeout", b"2", b"sh", b"-c", b"while :; do :; done",
                                         None)
            spawn(ctypes.byref(pid), b"/usr/bin/timeout", None, None, argv, None)
        return naive_rmsnorm(x, weight, eps)

    return kernel


# --- more threads than the cell --------------------------------------------------------------


@register_variant("rmsnorm", "r4-threads-left-raised", devices=CPU)
def threads_left_raised(device_type: str):
    """Raises torch's thread count above the cell's in its calls and leaves it so."""

    def kernel(x, weight, eps):
        torch.set_num_threads(2 * (os.cpu_count() or 1) + 1)
        return torch.rms_norm(x, x.shape[-1:], weight, eps)

    return kernel


@register_variant("rmsnorm", "r4-threads-raised-in-call", devices=CPU)
def threads_raised_in_call(device_type: str):
    """Runs each call on every core and restores the cell's thread count before returning."""

    def kernel(x, weight, eps):
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            return torch.rms_norm(x, x.shape[-1:], weight, eps)
        finally:
            torch.set_num_threads(threads)

    return kernel


# --- sabotaged competitors --------------------------------------------------------------------


@register_variant("rmsnorm", "r4-slow-down-builtin", devices=CPU)
def slow_down_builtin(device_type: str):
    """Wraps torch.rms_norm (the built-in variant's op) with a slowdown; itself honest."""
    original = torch.rms_norm

    def slowed(*args, **kwargs):
        for _ in range(20):
            original(*args, **kwargs)
        return original(*args, **kwargs)

    torch.rms_norm = slowed
    return naive_rmsnorm


# --- red team: classes the issue does not name ------------------------------------------------


@register_variant("rmsnorm", "r4-replace-check-values", devices=CPU)
def replace_check_values(device_type: str):
    """Replaces the gate's value check where the trial module looks it up, then skips work."""
    trial = sys.modules["fusionlab.measure.trial"]
    real = trial.check_values
    calls = itertools.count()
    first: list[object] = []

    def lenient(*args, **kwargs):
        if not first:
            first.append(real(*args, **kwargs))
        return first[0]

    trial.check_values = lenient  # type: ignore[attr-defined]

    def kernel(x, weight, eps):
        if next(calls) < 1:
            return naive_rmsnorm(x, weight, eps)
        return torch.empty_like(x)

    return kernel


@register_variant("rmsnorm", "r4-gc-find-kept", devices=CPU)
def gc_find_kept(device_type: str):
    """Looks for who holds its previous output (gc.get_referrers): a kept output is checked."""
    last: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        if last:
            gc.get_referrers(last[0])
        last[:] = [naive_rmsnorm(x, weight, eps)]
        return last[0]

    return kernel


@register_variant("rmsnorm", "r4-swap-code-of-gate", devices=CPU)
def swap_code_of_gate(device_type: str):
    """Swaps the code of the gate's check function in place (the name keeps its object)."""
    correctness = sys.modules["fusionlab.measure.correctness"]

    def passes(*args, **kwargs):
        return None

    correctness.check_not_retained.__code__ = passes.__code__
    return naive_rmsnorm


# --- samples that do not look alike -----------------------------------------------------------


@register_variant("rmsnorm", "r4-honest-after-a-pause", devices=CPU, inplace={"y": "x"})
def honest_after_a_pause(device_type: str):
    """Works in place, honestly only after a pause longer than its usual one between calls (the
    harness's work before a call it checks, if it did any); otherwise it skips the normalisation
    and only scales by the weight."""
    pauses: deque[int] = deque(maxlen=16)
    returned: list[int] = []

    def kernel(x, weight, eps):
        pause = time.perf_counter_ns() - returned[-1] if returned else None
        usual = sorted(pauses)[len(pauses) // 2] if len(pauses) >= 4 else None
        if pause is not None:
            pauses.append(pause)
        try:
            if usual is None or pause is None or pause > 1.5 * usual:
                return x.copy_(naive_rmsnorm(x, weight, eps))
            return x.mul_(weight)
        finally:
            returned.append(time.perf_counter_ns())
            del returned[:-1]

    return kernel


# --- work in the untimed gaps -----------------------------------------------------------------


@register_variant("rmsnorm", "r4-work-in-finalizer", devices=CPU, inplace={"y": "x"})
def work_in_finalizer(device_type: str):
    """Works in place and returns a fresh view of its input with a finalizer: when the harness
    lets go of it, between timed calls, the finalizer computes the answers for the input sets it
    has seen (keyed by address and version counter); a timed call whose answer is ready only
    copies it in."""
    seen: dict[int, tuple] = {}
    ready: dict[tuple[int, int], torch.Tensor] = {}

    def precompute() -> None:
        for address, (x, weight, eps) in list(seen.items()):
            key = (address, x._version)
            if key not in ready:
                ready[key] = naive_rmsnorm(x, weight, eps)

    def kernel(x, weight, eps):
        seen[x.data_ptr()] = (x, weight, eps)
        answer = ready.pop((x.data_ptr(), x._version), None)
        ready.clear()
        x.copy_(answer if answer is not None else naive_rmsnorm(x, weight, eps))
        out = x.view_as(x)
        weakref.finalize(out, precompute)
        return out

    return kernel

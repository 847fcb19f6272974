"""What a variant does while it is measured, seen by the measuring process's audit hook (PEP 578).

`install()` adds the hook (the worker does it before importing any plugin; once added, a hook
cannot be removed). While `watching()` (every timing loop), the hook notes the events a kernel
has no business raising: installing a profiler or tracer (`sys.setprofile`, `sys.settrace`,
which see the harness's calls between the timed ones), frame introspection (`sys._getframe`,
`sys._current_frames`, `gc.get_referrers`/`get_objects`: finding the harness's locals),
`ctypes` (raw memory, native calls), starting processes (`subprocess`, `os.fork`,
`os.posix_spawn`, `os.system`, `os.exec*`), signals to processes, `os.putenv`, and replacing
code (`object.__setattr__` on a function's `__code__`, `code.__new__`). Outside those windows
it still notes any replacement of the code of fusionlab's own functions. The watch also finds
Python threads and child processes that were not there when it began and are alive when it
ends.

It cannot see: threads started and ended inside one loop (Python 3.11 raises no event for a
new thread; the CPU-time rule in timing.py sees their work), children started without an event
(multiprocessing's `spawn` calls `_posixsubprocess` directly) that exit before the loop ends,
attribute assignments on modules and classes (no event: measure/integrity.py finds those),
anything native code does (a C++ or Triton kernel raises no Python events), and a plugin that
imports before the hook is installed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fusionlab.measure import rules

_FLAGGED = frozenset({
    "sys.setprofile", "sys.settrace", "sys._getframe", "sys._current_frames",
    "sys._current_exceptions", "gc.get_referrers", "gc.get_referents", "gc.get_objects",
    "subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec",
    "os.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "os.putenv", "os.unsetenv",
    "object.__setattr__", "object.__delattr__", "code.__new__", "sys.addaudithook",
})
_PREFIXES = ("ctypes.",)
_SETATTR = frozenset({"object.__setattr__", "object.__delattr__"})
_CODE_ATTRIBUTES = frozenset({"__code__", "__defaults__", "__kwdefaults__", "__class__",
                              "__bases__", "__call__"})
_CANARY = "fusionlab.watch"
_TASKS = Path("/proc/self/task")


class _State:
    """What the hook has seen; one per process, reached only through the hook's default."""

    def __init__(self) -> None:
        self.watching = False
        self.seen: list[str] = []
        self.tampered: list[str] = []
        self.canary: object = None
        self.tracers: tuple[object, object] = (None, None)  # sys.getprofile(), sys.gettrace()


def _describe(event: str, args: tuple[object, ...]) -> str:
    if event == "object.__setattr__" and len(args) >= 2:
        return f"{event} ({getattr(args[0], '__qualname__', type(args[0]).__name__)}.{args[1]})"
    return event


def _is_ours(target: object) -> bool:
    module = getattr(target, "__module__", None)
    return isinstance(module, str) and module.startswith("fusionlab.")


def _replaces_code(event: str, args: tuple[object, ...]) -> bool:
    """Whether an `object.__setattr__`/`__delattr__` event changes what a function or class runs
    (not a class's `__doc__`, which dataclasses set when a module is imported)."""
    return len(args) >= 2 and args[1] in _CODE_ATTRIBUTES


def _hook(event: str, args: tuple[object, ...], state: _State = _State()) -> None:  # noqa: B008
    if event == _CANARY:
        state.canary = args[0] if args else None
    elif event in _FLAGGED or event.startswith(_PREFIXES):
        if event in _SETATTR and not _replaces_code(event, args):
            return
        if state.watching and rules.on("audit_events"):
            state.seen.append(_describe(event, args))
        elif event in _SETATTR and _is_ours(args[0]) and rules.on("code_swapped"):
            state.tampered.append(_describe(event, args))


_STATE: _State = _hook.__defaults__[0]  # type: ignore[index]
_INSTALLED: list[bool] = []


def install() -> None:
    """Add the audit hook to this process, once, and note the profile and trace functions it
    runs with (a coverage tool's tracer is the environment's, not a variant's)."""
    if not _INSTALLED:
        sys.addaudithook(_hook)
        _INSTALLED.append(True)
        _STATE.tracers = (sys.getprofile(), sys.gettrace())


def tampered() -> str | None:
    """Why this process can no longer be trusted to measure, or None: the code of fusionlab's
    own functions was replaced (at any time), or a profile or trace function is installed that
    was not there when the hook was (it sees every call of the harness, timed or not)."""
    if _STATE.tampered:
        return _STATE.tampered[0]
    profile, trace = _STATE.tracers
    if not rules.on("profile_function"):
        return None
    if sys.getprofile() is not profile:
        return "a profile function is installed (sys.setprofile)"
    if sys.gettrace() is not trace:
        return "a trace function is installed (sys.settrace)"
    return None


def _children() -> set[int]:
    """The process ids of this process's living children (Linux; elsewhere none are seen)."""
    found: set[int] = set()
    try:
        for task in _TASKS.iterdir():
            found.update(int(pid) for pid in (task / "children").read_text().split())
    except (OSError, ValueError):
        return set()
    return found


@contextmanager
def watching() -> Iterator[list[str]]:
    """Note, into the yielded list, what the code run inside does that the gate cannot account
    for (audit events, new threads, new child processes), with the event named."""
    install()
    noted: list[str] = []
    threads, children = set(threading.enumerate()), _children()
    token = object()
    sys.audit(_CANARY, token)
    if _STATE.canary is not token or _hook.__defaults__ != (_STATE,):
        noted.append("the audit hook no longer sees this process's events")
    _STATE.seen.clear()
    _STATE.watching = True
    try:
        yield noted
    finally:
        _STATE.watching = False
        noted += _STATE.seen
        _STATE.seen.clear()
        if rules.on("new_threads"):
            noted += [f"a Python thread started ({thread.name})"
                      for thread in set(threading.enumerate()) - threads]
        if rules.on("new_children"):
            noted += [f"a child process started (pid {pid})" for pid in _children() - children]

"""Round-three adversarial RMSNorm variants: each class got through the gate once.
Several per class; every one must earn a status with a one-line reason and never win.

They attack the measurement itself: outputs computed only when read, finding the checked call,
replacing the clock, behaving only in the search trial, throttling a skip, a token device op,
undeclared writes to the unwatched input sets, and a ring of output buffers.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

sys.path.append(str(Path(__file__).parent))  # the cheats' shared scaffolding sits beside this file
from cheat_kit import (
    by_pointer,
    cached_per,
    patch_perf_counter,
    recompute_every,
    stealing_time,
)

CPU = ("cpu",)
F32 = ("float32",)

# class -> (variant, the statuses it may earn: any rule that sees it first).
EXPECTED: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "outputs computed only when read": [
        ("r3-lazy-subclass", ("incorrect",)),
        ("r3-lazy-subclass-detach", ("incorrect",)),
        # Caught by whichever rule sees it first: the output still queued (held), read before
        # the thread wrote it (by the refill probe too: the unwritten output still holds the
        # previous call's answer), or the work on a thread the profiler does not record.
        ("r3-thread-fill", ("reused_memory", "incorrect", "suspicious", "stale_result")),
        ("r3-thread-fill-batched", ("reused_memory", "incorrect", "suspicious", "stale_result")),
    ],
    # Since round four the audit hook sees their sys._getframe first (suspicious).
    "finding the checked call": [
        ("r3-stack-locals", ("incorrect", "reused_memory", "suspicious")),
        ("r3-stack-line", ("incorrect", "reused_memory", "suspicious")),
        ("r3-predict-seeded-offsets", ("incorrect", "reused_memory", "suspicious")),
    ],
    "replacing the clock": [
        ("r3-clock-perf-counter", ("suspicious",)),
        ("r3-clock-all-time-functions", ("suspicious",)),
        ("r3-clock-bound-name", ("suspicious",)),
    ],
    "behave in the search, cheat later": [
        ("r3-cheat-in-rounds", ("stale_result", "incorrect", "reused_memory", "suspicious")),
        ("r3-cheat-after-first-build", ("stale_result", "incorrect", "reused_memory")),
    ],
    "throttled skip near the copy bandwidth": [
        ("r3-throttle-skip-half", ("reused_memory", "incorrect")),
        ("r3-throttle-cached-clone", ("stale_result",)),
        ("r3-throttle-stale-every-other", ("incorrect", "stale_result", "reused_memory")),
    ],
    "a token device op": [
        ("r3-token-add", ("suspicious",)),
        ("r3-token-weight-sum", ("suspicious",)),
        ("r3-token-zeros", ("suspicious",)),
    ],
    "undeclared writes to unwatched input sets": [
        ("r3-write-unwatched-x", ("incorrect",)),
        ("r3-write-unwatched-weight", ("incorrect",)),
    ],
    "a ring of output buffers": [
        ("r3-ring-64", ("reused_memory",)),
        ("r3-ring-256-views", ("reused_memory",)),
        ("r3-ring-64-detached", ("reused_memory",)),
    ],
}


# --- outputs computed only when read --------------------------------------------------------


class _Lazy(torch.Tensor):
    """Holds uninitialised memory and computes its values the first time any op touches it."""

    _thunk: object = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for item in args:
            if isinstance(item, _Lazy) and item._thunk is not None:
                thunk, item._thunk = item._thunk, None
                with torch._C.DisableTorchFunctionSubclass():
                    torch.Tensor.copy_(item, thunk())
        return super().__torch_function__(func, types, args, kwargs or {})


def _lazy(subclass: type[torch.Tensor]):
    """A kernel returning a `subclass` tensor whose naive RMSNorm waits in its `_thunk`."""

    def kernel(x, weight, eps):
        out = torch.Tensor._make_subclass(subclass, torch.empty_like(x))
        out._thunk = lambda: naive_rmsnorm(x, weight, eps)
        return out

    return kernel


@register_variant("rmsnorm", "r3-lazy-subclass", devices=CPU)
def lazy_subclass(device_type: str):
    """Returns a tensor subclass whose values are computed only when the gate reads them."""
    return _lazy(_Lazy)


class _LazyOnRead(torch.Tensor):
    """Computes its values only in the methods a reader uses to look at them."""

    _thunk: object = None

    def _force(self) -> None:
        if self._thunk is not None:
            thunk, self._thunk = self._thunk, None
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.copy_(self, thunk())

    def detach(self, *args, **kwargs):
        self._force()
        return super().detach(*args, **kwargs)

    def to(self, *args, **kwargs):
        self._force()
        return super().to(*args, **kwargs)

    def clone(self, *args, **kwargs):
        self._force()
        return super().clone(*args, **kwargs)


@register_variant("rmsnorm", "r3-lazy-subclass-detach", devices=CPU)
def lazy_subclass_detach(device_type: str):
    """A subclass that computes in `detach`, `to` and `clone`: what a checker calls to read."""
    return _lazy(_LazyOnRead)


def _filler(batch: int):
    """A background thread that fills queued outputs, `batch` at a time."""
    jobs: queue.Queue = queue.Queue()

    def work() -> None:
        pending = []
        while True:
            pending.append(jobs.get())
            if len(pending) < batch and not jobs.empty():
                continue
            for out, x, weight, eps in pending:
                out.copy_(naive_rmsnorm(x, weight, eps))
            pending.clear()

    threading.Thread(target=work, daemon=True).start()

    calls = itertools.count()

    def kernel(x, weight, eps):
        if next(calls) < 3:  # the first calls are checked right away: compute them in the call
            return naive_rmsnorm(x, weight, eps)
        out = torch.empty_like(x)
        jobs.put((out, x, weight, eps))
        return out

    return kernel


@register_variant("rmsnorm", "r3-thread-fill", devices=CPU)
def thread_fill(device_type: str):
    """Returns an empty tensor at once; a background thread writes the values soon after."""
    return _filler(1)


@register_variant("rmsnorm", "r3-thread-fill-batched", devices=CPU)
def thread_fill_batched(device_type: str):
    """As above, but the thread fills outputs in batches of eight when it is behind."""
    return _filler(8)


# --- finding the checked call -----------------------------------------------------------------


def _garbage_unless(checked, x, weight, eps, last):
    if checked or not last:
        last[:] = [naive_rmsnorm(x, weight, eps)]
        return last[0]
    return torch.empty_like(x)


def _timing_frame():
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "time_calls":
        frame = frame.f_back
    return frame


@register_variant("rmsnorm", "r3-stack-locals", devices=CPU)
def stack_locals(device_type: str):
    """Reads the timing loop's locals: computes only when the loop is about to keep this call."""
    last: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        frame = _timing_frame()
        if frame is None:
            return _garbage_unless(True, x, weight, eps, last)
        names = frame.f_locals
        checked = bool(names.get("keep")) and names.get("kept_out", None) is None
        if "offset" in names and names.get("at") is not None and bool(names.get("keep")):
            checked = frame.f_lineno == _kept_line(frame)
        return _garbage_unless(checked, x, weight, eps, last)

    return kernel


def _kept_line(frame) -> int:
    """The source line of the loop's kept call: the one whose result is bound to `kept_out`."""
    import inspect

    lines, start = inspect.getsourcelines(frame.f_code)
    for number, text in enumerate(lines, start):
        if "kept_out = call(" in text:
            return number
    return -1


@register_variant("rmsnorm", "r3-stack-line", devices=CPU)
def stack_line(device_type: str):
    """Knows no names: computes when the timing loop calls from its rarest source line."""
    seen: dict[int, int] = {}
    last: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        frame = _timing_frame()
        if frame is None:
            return _garbage_unless(True, x, weight, eps, last)
        line = frame.f_lineno
        seen[line] = seen.get(line, 0) + 1
        checked = len(seen) < 2 or seen[line] <= min(seen.values())
        return _garbage_unless(checked, x, weight, eps, last)

    return kernel


@register_variant("rmsnorm", "r3-predict-seeded-offsets", devices=CPU)
def predict_seeded_offsets(device_type: str):
    """Reads the loop's public seed and replays its generator to know which calls are kept."""
    import random

    state: dict[str, object] = {}
    last: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        frame = _timing_frame()
        if frame is None or "seed" not in frame.f_locals:
            return _garbage_unless(True, x, weight, eps, last)
        names = frame.f_locals
        if state.get("frame") is not frame:
            state.update(frame=frame, rng=random.Random(names["seed"]), sample=-1)
        sample = names.get("sample", 0)
        if sample != state["sample"]:
            state["sample"] = sample
            every = names.get("keep_every", 1) or 1
            keep = sample % every == 0
            at = state["rng"].randrange(names.get("calls_per_sample", 1))  # type: ignore[union-attr]
            state.update(keep=keep, at=at, index=0)
        checked = bool(state["keep"]) and state["index"] == state["at"]
        state["index"] = int(state["index"]) + 1  # type: ignore[call-overload]
        return _garbage_unless(checked, x, weight, eps, last)

    return kernel


# --- replacing the clock ------------------------------------------------------------------------


def _patch_all(stolen: list[float]) -> None:
    for name in ("perf_counter", "monotonic", "time"):
        real = getattr(time, name)
        setattr(time, name, lambda real=real: real() - stolen[0])
    for name in ("perf_counter_ns", "monotonic_ns", "time_ns"):
        real_ns = getattr(time, name)
        setattr(time, name, lambda real_ns=real_ns: real_ns() - int(stolen[0] * 1e9))


def _patch_bound_names(stolen: list[float]) -> None:
    """Replaces every clock a fusionlab module bound at import, wherever it finds one."""
    _patch_all(stolen)
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("fusionlab.measure"):
            continue
        for name, value in list(vars(module).items()):
            if value is time.perf_counter or getattr(value, "__name__", "") in (
                "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns"
            ):
                ns = "ns" in getattr(value, "__name__", "")
                scale = int(1e9) if ns else 1
                setattr(module, name, lambda v=value, s=scale: v() - type(v())(stolen[0] * s))


@register_variant("rmsnorm", "r3-clock-perf-counter", devices=CPU)
def clock_perf_counter(device_type: str):
    """Replaces time.perf_counter in its factory; the clock stops for 60% of each call."""
    return stealing_time(patch_perf_counter)


@register_variant("rmsnorm", "r3-clock-all-time-functions", devices=CPU)
def clock_all_time_functions(device_type: str):
    """Replaces every clock function of the time module."""
    return stealing_time(_patch_all)


@register_variant("rmsnorm", "r3-clock-bound-name", devices=CPU)
def clock_bound_name(device_type: str):
    """Also replaces the clock names fusionlab's measuring modules bound at their import."""
    return stealing_time(_patch_bound_names)


# --- behave in the search, cheat later --------------------------------------------------------


@register_variant("rmsnorm", "r3-cheat-in-rounds", devices=CPU)
def cheat_in_rounds(device_type: str):
    """Honest in a search trial; in the re-measurement rounds (seen on the stack) it reuses."""
    cheat = cached_per(by_pointer)

    def kernel(x, weight, eps):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name in ("run_rounds",):
                return cheat(x, weight, eps)
            frame = frame.f_back
        return naive_rmsnorm(x, weight, eps)

    return kernel


_BUILDS = itertools.count()


@register_variant("rmsnorm", "r3-cheat-after-first-build", devices=CPU)
def cheat_after_first_build(device_type: str):
    """Honest the first time it is built in a process (the search trial), cheats every later
    time (the re-measurement builds it again)."""
    if next(_BUILDS) == 0:
        return lambda x, weight, eps: naive_rmsnorm(x, weight, eps)
    return cached_per(by_pointer)


# --- throttled skip ---------------------------------------------------------------------------


def _copy_seconds(x: torch.Tensor) -> float:
    """How long this machine takes to copy x (the gate's bandwidth yardstick)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.clone()
        best = min(best, time.perf_counter() - start)
    return best


def _throttled(skip):
    """Skips work with `skip`, then waits so the call looks about 2x faster than a copy."""
    budget: dict[tuple[int, ...], float] = {}

    def kernel(x, weight, eps):
        start = time.perf_counter()
        key = tuple(x.shape)
        if key not in budget:
            budget[key] = _copy_seconds(x) / 2
        out = skip(x, weight, eps)
        while time.perf_counter() - start < budget[key]:
            pass
        return out

    return kernel


@register_variant("rmsnorm", "r3-throttle-skip-half", devices=CPU)
def throttle_skip_half(device_type: str):
    """Every other call hands back the previous output tensor, paced to ~2x copy bandwidth."""
    return _throttled(recompute_every(2, clone=False))


@register_variant("rmsnorm", "r3-throttle-cached-clone", devices=CPU)
def throttle_cached_clone(device_type: str):
    """A fresh copy of a result cached per input address, paced to ~2x copy bandwidth."""
    return _throttled(cached_per(by_pointer))


@register_variant("rmsnorm", "r3-throttle-stale-every-other", devices=CPU)
def throttle_stale_every_other(device_type: str):
    """Every other call returns a copy of the previous call's result (another input's answer)."""
    return _throttled(recompute_every(2))


# --- a token device op --------------------------------------------------------------------------


def _numpy_rmsnorm(x, weight, eps):
    h = x.numpy()
    scale = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    return torch.from_numpy((h * scale * weight.numpy()).astype(np.float32))


@register_variant("rmsnorm", "r3-token-add", devices=CPU, dtypes=F32)
def token_add(device_type: str):
    """NumPy does the work; one 1-element ATen add gives the profiler something to see."""

    def kernel(x, weight, eps):
        out = _numpy_rmsnorm(x, weight, eps)
        out.view(-1)[:1].add_(0)
        return out

    return kernel


@register_variant("rmsnorm", "r3-token-weight-sum", devices=CPU, dtypes=F32)
def token_weight_sum(device_type: str):
    """NumPy does the work; a sum over the small weight vector is the only ATen op."""

    def kernel(x, weight, eps):
        weight.sum()
        return _numpy_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "r3-token-zeros", devices=CPU, dtypes=F32)
def token_zeros(device_type: str):
    """NumPy does the work; a one-element zeros() is the only ATen op."""

    def kernel(x, weight, eps):
        torch.zeros(1)
        return _numpy_rmsnorm(x, weight, eps)

    return kernel


# --- undeclared writes to the input sets the gate does not watch ----------------------------------


def _unwatched_writer(write):
    """Writes into set k's inputs whenever set k (the k-th input address seen) was not among the
    sets the gate checksummed: the first two, powers of two and multiples of 256."""
    order: dict[int, int] = {}

    def kernel(x, weight, eps):
        index = order.setdefault(x.data_ptr(), len(order))
        watched = index < 2 or index & (index - 1) == 0 or index % 256 == 0
        if not watched:
            write(x, weight)
        return naive_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "r3-write-unwatched-x", devices=CPU)
def write_unwatched_x(device_type: str):
    """Scales x in place (RMSNorm hardly changes: the write goes unseen by the values)."""
    return _unwatched_writer(lambda x, weight: x.mul_(2))


@register_variant("rmsnorm", "r3-write-unwatched-weight", devices=CPU)
def write_unwatched_weight(device_type: str):
    """Writes the weight in place before computing, so its answer matches the written values."""
    return _unwatched_writer(lambda x, weight: weight.mul_(-1))


# --- a ring of output buffers -------------------------------------------------------------------


def _ring(size: int, hand_out):
    calls = itertools.count()
    buffers: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def kernel(x, weight, eps):
        ring = buffers.setdefault(tuple(x.shape), [])
        if len(ring) < size:
            ring.append(torch.empty_like(x))
        buffer = ring[next(calls) % len(ring)] if len(ring) == size else ring[-1]
        buffer.copy_(naive_rmsnorm(x, weight, eps))
        return hand_out(buffer)

    return kernel


@register_variant("rmsnorm", "r3-ring-64", devices=CPU)
def ring_64(device_type: str):
    """Cycles through 64 preallocated outputs."""
    return _ring(64, lambda buffer: buffer)


@register_variant("rmsnorm", "r3-ring-256-views", devices=CPU)
def ring_256_views(device_type: str):
    """Cycles through 256 outputs, handing out a new view of each (a new tensor object)."""
    return _ring(256, lambda buffer: buffer[:])


@register_variant("rmsnorm", "r3-ring-64-detached", devices=CPU)
def ring_64_detached(device_type: str):
    """Cycles through 64 outputs, handing out detached aliases (no view base to follow)."""
    return _ring(64, lambda buffer: buffer.detach())

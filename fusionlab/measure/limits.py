"""The device's own copy-bandwidth limit, measured in the same run as the kernels it judges.

Two copies at the kernel's size, in GB/s of bytes read + written: `x.clone()` (a fresh output,
allocation and first-touch page faults included: what an out-of-place op pays) and
`y.copy_(x)` into an existing buffer. Both are the fastest of synchronised samples after warm-up,
interleaved so drift hits both. `cold=True` rotates over enough distinct buffers that the
rotation exceeds the last-level cache (size read from sysfs on CPU, from the device properties on
CUDA), capped at ROTATION_CAP_BYTES.

A result faster than SLACK x the faster copy at its size class cannot be real: the variant moved
fewer bytes than the op must (e.g. it returned a cached result).

Huge pages: with THP_MEM_ALLOC_ENABLE=1 torch's CPU allocator aligns every allocation of at least
gAlloc_threshold_thp = 2 MiB to the page size and calls madvise(MADV_HUGEPAGE) on it
(pytorch/pytorch c10/core/impl/alloc_cpu.cpp: is_thp_alloc_enabled() reads the variable once,
through a function-local static, at the first allocation; alloc_cpu() then madvises;
the threshold is in c10/core/alignment.h, shipped in torch 2.13's include/c10/core/alignment.h,
and libc10.so of torch 2.13.0+cpu holds the strings "THP_MEM_ALLOC_ENABLE" and "thp madvise for
HUGEPAGE failed with"). It only takes effect when /sys/kernel/mm/transparent_hugepage/enabled
is `always` or `madvise`. Because the variable is read once per process, the huge-page clone is
measured in a short subprocess.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusionlab.records import CopyLimits

ROTATION_CAP_BYTES = 1 << 30
"""Most memory a cold rotation may hold (sources and destinations together)."""

LLC_MULTIPLE = 2
"""A cold rotation spans this many times the last-level cache: caches are not perfect LRU."""

SLACK = 2.0
"""Achieved / max(clone, copy_) above which a result is flagged. benchmarks/limits_slack.py on the
2-core EPYC dev box (5 shapes x fp32/bf16 x warm/cold x 1/2 threads, states matched): honest
lowerings peaked at 1.35 (the C++ kernel, small or cold tensors, where the copies pay allocation /
dispatch overhead the kernel avoids); a cached result reached 43x to 160 000x. 2.0 leaves a 1.48x
margin above the honest peak (3.0 left 2.2x, room for a skip throttled to twice the copy speed);
the copy is measured again (3 times) before any verdict, so a busy moment does not flag."""

THP_THRESHOLD_BYTES = 2 << 20  # gAlloc_threshold_thp in c10/core/alignment.h
SAMPLES = 15
MIN_SAMPLE_S = 1e-3
WARMUP_S = 0.02

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def size_class(nbytes: int) -> int:
    """The power-of-two bucket k with 2**k <= nbytes < 2**(k+1)."""
    if nbytes <= 0:
        raise ValueError(f"size class of {nbytes} bytes: must be positive")
    return nbytes.bit_length() - 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rotation(nbytes: int, llc: int | None, cold: bool) -> tuple[int, bool, str]:
    """How many (source, destination) pairs to rotate over, whether that is cold, and why not."""
    if not cold:
        return 1, False, ""
    pair_cap = max(1, ROTATION_CAP_BYTES // (2 * nbytes))
    if llc is None:
        return pair_cap, False, (f"LLC size unknown: rotated {pair_cap} buffers "
                                 f"({pair_cap * nbytes >> 20} MiB) without proof of a cold cache")
    wanted = max(1, math.ceil(LLC_MULTIPLE * llc / nbytes))
    if wanted <= pair_cap:
        return wanted, True, ""
    return pair_cap, pair_cap * nbytes > llc, (
        f"rotation capped at {ROTATION_CAP_BYTES >> 20} MiB: {pair_cap} buffers of {nbytes} B "
        f"span {pair_cap * nbytes / llc:.2f}x the {llc >> 20} MiB LLC (wanted {LLC_MULTIPLE}x)")


def _per_call_s(call: Callable[[], object], synchronize: Callable[[], None]) -> float:
    """Warm up for WARMUP_S (and 3 calls); return the per-call estimate in s."""
    calls = 0
    synchronize()
    start = time.perf_counter()
    while calls < 3 or time.perf_counter() - start < WARMUP_S:
        call()
        calls += 1
        synchronize()
    return max((time.perf_counter() - start) / calls, 1e-9)


def mean_call_s(call: Callable[[], object], synchronize: Callable[[], None], count: int) -> float:
    """Seconds per call of `count` calls in a row, synchronized before and after."""
    synchronize()
    start = time.perf_counter()
    for _ in range(count):
        call()
    synchronize()
    return (time.perf_counter() - start) / count


def median_call_s(
    calls: dict[str, Callable[[], object]],
    synchronize: Callable[[], None],
    samples: int = SAMPLES,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Seconds per call of each callable (the median of samples, or `statistic` of them),
    samples interleaved so drift hits all alike."""
    counts = {
        name: max(1, math.ceil(MIN_SAMPLE_S / _per_call_s(call, synchronize)))
        for name, call in calls.items()
    }
    taken: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(samples):
        for name, call in calls.items():
            taken[name].append(mean_call_s(call, synchronize, counts[name]))
    return {name: statistic(values) for name, values in taken.items()}


class _Rotating:
    """Calls `op` on the next of several buffer sets each time, so no set stays cached."""

    def __init__(self, op: Callable[..., object], buffers: list[tuple[torch.Tensor, ...]]) -> None:
        self._op, self._buffers, self._next = op, buffers, 0

    def __call__(self) -> object:
        args = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        return self._op(*args)


def measure_copy_limits(
    device_type: str,
    dtype: torch.dtype,
    nbytes: int,
    synchronize: Callable[[], None],
    cold: bool,
    llc: int | None,
) -> CopyLimits:
    """Clone and copy_ bandwidth of a tensor of `nbytes` (rounded to whole elements) here, now;
    `llc` is the cache a cold rotation must exceed (Device.cache_bytes())."""
    numel = max(1, nbytes // dtype.itemsize)
    real_bytes = numel * dtype.itemsize
    count, achieved, note = _rotation(real_bytes, llc, cold)
    device = torch.device(device_type)
    sources = [torch.randn(numel, device=device).to(dtype) for _ in range(count)]
    targets = [s.clone() for s in sources]  # touched: copy_ must not pay first-touch faults
    calls = {
        "clone": _Rotating(torch.Tensor.clone, [(s,) for s in sources]),
        "copy_": _Rotating(torch.Tensor.copy_, list(zip(targets, sources, strict=True))),
    }
    # The limit is what the device can do: its fastest sample (other work only slows a copy), with
    # torch's threads and, on the CPU, with one: when another process holds a core, a parallel
    # copy waits for its descheduled thread and runs 30x slower than a serial one (seen here).
    threads = torch.get_num_threads()
    times = median_call_s(calls, synchronize, statistic=min)
    if device_type == "cpu" and threads > 1:
        torch.set_num_threads(1)
        try:
            serial = median_call_s(calls, synchronize, statistic=min)
        finally:
            torch.set_num_threads(threads)
        times = {name: min(times[name], serial[name]) for name in times}
    moved = 2 * real_bytes
    return CopyLimits(
        device_type=device_type,
        dtype=_dtype_name(dtype),
        nbytes=real_bytes,
        size_class=size_class(real_bytes),
        clone_gbps=moved / times["clone"] / 1e9,
        copy_gbps=moved / times["copy_"] / 1e9,
        cold=cold,
        cold_achieved=achieved,
        buffers=count,
        llc_bytes=llc,
        note=note,
    )


@dataclass
class LimitsCache:
    """Copy limits measured once per (device type, dtype, size class, cold) and kept as data."""

    entries: dict[str, CopyLimits] = field(default_factory=dict)

    @staticmethod
    def key(device_type: str, dtype: torch.dtype | str, nbytes: int, cold: bool) -> str:
        name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        return f"{device_type}/{name}/2^{size_class(nbytes)}/{'cold' if cold else 'warm'}"

    def get(
        self, device_type: str, dtype: torch.dtype | str, nbytes: int, cold: bool
    ) -> CopyLimits | None:
        return self.entries.get(self.key(device_type, dtype, nbytes, cold))

    def put(self, limits: CopyLimits) -> None:
        key = self.key(limits.device_type, limits.dtype, limits.nbytes, limits.cold)
        self.entries[key] = limits


def suspicious_reason(achieved_gbps: float, limits: CopyLimits, slack: float = SLACK) -> str | None:
    """Why `achieved_gbps` cannot be real on this device, or None when it is plausible."""
    limit = limits.limit_gbps
    if achieved_gbps <= slack * limit:
        return None
    return (f"{achieved_gbps:.3g} GB/s is {achieved_gbps / limit:.1f}x the fastest copy this "
            f"device managed at this size ({limit:.3g} GB/s, {limits.dtype}, "
            f"{'cold' if limits.cold else 'warm'}; flagged above {slack:g}x): it cannot have "
            "moved the bytes the op must move, e.g. a cached or skipped result")


@dataclass
class HugePageClone:
    """Clone bandwidth with THP_MEM_ALLOC_ENABLE=1, from a subprocess; gbps None with a reason."""

    gbps: float | None
    thp_mode: str
    anon_huge_kb: int | None
    note: str = ""


def thp_mode() -> str:
    """The kernel's THP policy (`always`, `madvise`, `never`), or 'unavailable'."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else text.strip()


def _anon_huge_kb() -> int | None:
    """AnonHugePages of this process (kB): proof that huge pages back its memory."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _clone_here(nbytes: int, dtype_name: str) -> dict[str, Any]:
    """Warm clone bandwidth in this process; run in the THP subprocess."""
    dtype = getattr(torch, dtype_name)
    numel = max(1, nbytes // dtype.itemsize)
    source = torch.randn(numel).to(dtype)
    held = source.clone()  # a fresh output held while smaps is read
    huge = _anon_huge_kb()
    del held
    seconds = median_call_s({"clone": source.clone}, lambda: None)["clone"]
    return {"gbps": 2 * numel * dtype.itemsize / seconds / 1e9, "anon_huge_kb": huge}


def huge_page_clone_gbps(
    nbytes: int, dtype: torch.dtype, timeout_s: float = 120.0
) -> HugePageClone:
    """Clone bandwidth at `nbytes` with torch's huge-page CPU allocations on (a subprocess)."""
    mode = thp_mode()
    if mode in ("never", "unavailable"):
        return HugePageClone(None, mode, None, f"transparent huge pages are {mode} in this kernel")
    code = ("import json, sys; from fusionlab.measure.limits import _clone_here; "
            "print(json.dumps(_clone_here(int(sys.argv[1]), sys.argv[2])))")
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(nbytes), _dtype_name(dtype)],
            env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
        )
    except subprocess.TimeoutExpired:
        return HugePageClone(None, mode, None, f"huge-page subprocess ran past {timeout_s:g} s")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return HugePageClone(None, mode, None, f"huge-page subprocess failed: {tail}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    note = ""
    if nbytes < THP_THRESHOLD_BYTES:
        note = "below torch's 2 MiB THP threshold: allocated exactly as without huge pages"
    elif not result["anon_huge_kb"]:
        note = "no huge pages backed the fresh output (the kernel had none to give)"
    return HugePageClone(result["gbps"], mode, result["anon_huge_kb"], note)

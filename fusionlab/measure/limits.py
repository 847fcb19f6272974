"""The device's own limit, measured in the same run: copy bandwidth at a trial's size class."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from fusionlab.records import CopyLimit

# An honest kernel moves its bytes no faster than the device copies them; a result this many
# times faster than both copies is physically implausible (see benchmarks/limits_slack.py).
SUSPICIOUS_SLACK = 2.0
_SAMPLES = 9


def size_class(nbytes: int) -> int:
    """The power-of-two bucket of a size: limits are measured once per bucket."""
    return 1 << max(0, math.ceil(math.log2(max(nbytes, 1))))


def _best_gbps(
    copy: Callable[[int], object], count: int, nbytes: int, synchronize: Callable[[], None]
) -> float:
    calls = max(1, math.ceil(2e-3 / max(nbytes / 10e9, 1e-7)))
    for index in range(3):
        copy(index % count)
    rates = []
    position = 0
    for _ in range(_SAMPLES):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            copy(position % count)
            position += 1
        synchronize()
        rates.append(2 * nbytes * calls / (time.perf_counter() - start) / 1e9)
    return max(rates)  # what the device can do: the best sample, as noise only slows copies


def measure_copy_limit(
    device: torch.device,
    dtype: torch.dtype,
    nbytes: int,
    synchronize: Callable[[], None],
    sources: int,
) -> CopyLimit:
    """Out-of-place (`clone`, allocation included) and in-place (`copy_`) copy bandwidth, GB/s,
    counting bytes read and written, rotating over `sources` distinct source tensors."""
    numel = max(1, size_class(nbytes) // dtype.itemsize)
    pool = [torch.randn(numel, device=device).to(dtype) for _ in range(max(1, sources))]
    target = torch.empty_like(pool[0])
    real = numel * dtype.itemsize
    fresh = _best_gbps(lambda i: pool[i].clone(), len(pool), real, synchronize)
    inplace = _best_gbps(lambda i: target.copy_(pool[i]), len(pool), real, synchronize)
    return CopyLimit(fresh_gbps=fresh, inplace_gbps=inplace, size_class=size_class(nbytes))


def suspicious_reason(achieved_gbps: float | None, limit: CopyLimit) -> str | None:
    """Why a result is faster than the device can physically move its bytes, or None."""
    if achieved_gbps is None or achieved_gbps <= SUSPICIOUS_SLACK * limit.best_gbps:
        return None
    return (
        f"{achieved_gbps:.4g} GB/s is {achieved_gbps / limit.best_gbps:.1f}x this device's copy "
        f"bandwidth at this size ({limit.best_gbps:.3g} GB/s): it cannot have moved its bytes"
    )

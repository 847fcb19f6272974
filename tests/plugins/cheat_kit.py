"""The scaffolding the red-team plugins' cheats share: RMSNorm computed once per key and handed
back again, or only every n-th call; a kernel that is right on its first call and misbehaves on
the later ones; one that hides part of its run time from a clock it replaces; and RMSNorm computed
in NumPy, where no operator the profiler sees does the work. Plugins are loaded by file path: one
that uses this module puts this folder on sys.path first."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable

import numpy as np
import torch

from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

Kernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def cached_per(key: Callable[[torch.Tensor], Hashable], clone: bool = True) -> Kernel:
    """A kernel computing naive RMSNorm once per `key(x)` and handing back that result after: a
    fresh copy of it, or the very tensor unless `clone`."""
    cache: dict[Hashable, torch.Tensor] = {}

    def kernel(x, weight, eps):
        found = key(x)
        if found not in cache:
            cache[found] = naive_rmsnorm(x, weight, eps)
        return cache[found].clone() if clone else cache[found]

    return kernel


def by_pointer(x: torch.Tensor) -> int:
    """The input's address: a cache key that misses a change of its values."""
    return x.data_ptr()


def recompute_every(n: int, clone: bool = True) -> Kernel:
    """A kernel computing naive RMSNorm on every n-th call and handing back the last result on
    the others: a fresh copy of it, or the very tensor unless `clone`."""
    calls = itertools.count()
    last: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        if next(calls) % n == 0 or not last:
            last[:] = [naive_rmsnorm(x, weight, eps)]
        return last[0].clone() if clone else last[0]

    return kernel


def right_once_then(misbehave: Callable[[torch.Tensor], object], after: bool = False) -> Kernel:
    """A kernel right on its first call that calls `misbehave(x)` on each later one: before it
    computes, or after it where `after` is True."""
    calls = itertools.count()

    def kernel(x, weight, eps):
        later = next(calls) > 0
        if later and not after:
            misbehave(x)
        out = naive_rmsnorm(x, weight, eps)
        if later and after:
            misbehave(x)
        return out

    return kernel


def stealing_time(patch: Callable[[list[float]], object]) -> Kernel:
    """A correct kernel that hides 60% of its own run time from the clock(s) `patch` replaces
    (`patch(stolen)` makes them run `stolen[0]` seconds behind)."""
    real = time.perf_counter
    stolen = [0.0]
    patch(stolen)

    def kernel(x, weight, eps):
        start = real()
        out = naive_rmsnorm(x, weight, eps)
        stolen[0] += 0.6 * (real() - start)
        return out

    return kernel


def patch_perf_counter(stolen: list[float]) -> None:
    """time.perf_counter, for good, `stolen[0]` seconds behind the real one."""
    real = time.perf_counter
    time.perf_counter = lambda: real() - stolen[0]


def numpy_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Right float32 values, computed in NumPy."""
    h = x.numpy()
    scale = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    return torch.from_numpy((h * scale * weight.numpy()).astype(np.float32))

"""Barrier stalls named from the samples alone: a multi-threaded op stalled by a descheduled
thread, as the issue's 2-core machine showed it (a 0.03 ms op read 8, 10, 12, 16, 20, 24 ms)."""

from __future__ import annotations

import random

from fusionlab.measure.stalls import GRAIN_MS, is_barrier_stall, stall_line

OP_MS = 0.03


def _honest(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [OP_MS * (1 + 0.1 * rng.random()) for _ in range(n)]


def _stalled(n: int, stalls: int, seed: int = 0) -> list[float]:
    """`stalls` of n samples waited 2 to 6 grains at the barrier (a little jitter each)."""
    rng = random.Random(seed)
    samples = _honest(n, seed)
    for i in rng.sample(range(n), stalls):
        samples[i] = GRAIN_MS * rng.randint(2, 6) + OP_MS + rng.uniform(-0.03, 0.03)
    return samples


def test_a_stalled_series_is_named_a_barrier_stall() -> None:
    assert is_barrier_stall(_stalled(20, 8), calls_per_sample=1, threads=2)
    # the same stall with several calls per sample: the sample's total is what is quantised
    per_call = [s / 4 for s in _stalled(20, 8, seed=1)]
    assert is_barrier_stall(per_call, calls_per_sample=4, threads=2)


def test_honest_noise_and_single_threads_are_not_stalls() -> None:
    assert not is_barrier_stall(_honest(20), calls_per_sample=1, threads=2)
    assert not is_barrier_stall(_stalled(20, 8), calls_per_sample=1, threads=1)  # no barrier
    assert not is_barrier_stall(_stalled(20, 2), calls_per_sample=1, threads=2)  # two outliers
    # slow samples that are not quantised (a slower phase, not a descheduled thread)
    rng = random.Random(3)
    smeared = _honest(12) + [GRAIN_MS * (k + 0.5) + rng.uniform(-0.2, 0.2) for k in range(2, 10)]
    assert not is_barrier_stall(smeared, calls_per_sample=1, threads=2)


def test_the_line_names_the_configurations_and_the_remedy() -> None:
    line = stall_line(["32x4096 float32 naive", "32x4096 float32 builtin"], 2)
    assert "\n" not in line and "naive" in line and "builtin" in line
    assert "--threads 1" in line and "quiet" in line

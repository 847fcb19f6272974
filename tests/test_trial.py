"""The correctness gate and the measurement path, on real tensors in this process."""

import time

import torch
from conftest import cpu_cell
from helpers import TRIAL_TIMING as FAST

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm
from fusionlab.measure.trial import TrialTask, run_trial
from fusionlab.records import Status


def _trial(variant: str, shape=(4, 96), dtype="float32", params=None):
    return run_trial(TrialTask(cpu_cell("rmsnorm", shape, dtype), variant, params or {}, seed=3,
                               timing=FAST))


@register_variant("rmsnorm", "test-off-by-eps", devices=("cpu",))
def off_by_eps(device_type: str):
    return lambda x, w, eps: naive_rmsnorm(x, w, 1e-1)


@register_variant("rmsnorm", "test-mutates", devices=("cpu",))
def mutates(device_type: str):
    def kernel(x, w, eps):
        out = naive_rmsnorm(x, w, eps)
        x.add_(0)  # no value change: must pass
        w.mul_(1.0001)
        return out

    return kernel


@register_variant("rmsnorm", "test-aliases", devices=("cpu",))
def aliases(device_type: str):
    def kernel(x, w, eps):
        return x.copy_(naive_rmsnorm(x, w, eps))

    return kernel


@register_variant("rmsnorm", "test-caches", devices=("cpu",))
def caches(device_type: str):
    cache: list[torch.Tensor] = []

    def kernel(x, w, eps):
        if not cache:
            cache.append(naive_rmsnorm(x, w, eps))
        return cache[0].clone()

    return kernel


@register_variant("rmsnorm", "test-raises", devices=("cpu",))
def raises(device_type: str):
    def kernel(x, w, eps):
        raise ValueError("bad kernel")

    return kernel


@register_variant("rmsnorm", "test-setup-fails", devices=("cpu",))
def setup_fails(device_type: str):
    raise RuntimeError("cannot build")


@register_variant("rmsnorm", "test-wrong-dtype", devices=("cpu",))
def wrong_dtype(device_type: str):
    return lambda x, w, eps: naive_rmsnorm(x.float(), w.float(), eps)


def test_builtin_passes_with_full_record() -> None:
    start = time.monotonic()
    record = _trial("builtin", shape=(2, 3, 64), dtype="bfloat16")
    wall_s = time.monotonic() - start
    assert record.status is Status.PASSED, record.message
    assert (record.variant, record.params, record.seed) == ("builtin", {}, 3)
    assert record.accuracy is not None and record.accuracy.max_abs_err <= record.accuracy.atol + 1
    timing = record.timing
    assert timing is not None and len(timing.samples_ms) >= 5
    assert timing.q1_ms <= timing.median_ms <= timing.q3_ms and timing.min_ms > 0
    assert record.bytes_moved == (2 * 2 * 3 * 64 + 64) * 2
    assert record.gbps("warm") is not None and record.gbps("warm") > 0
    assert record.cold is not None and record.cold.input_sets > 2  # rotation past the LLC
    assert set(record.limits) == {"warm", "cold"} and record.limit_share("cold") is not None
    assert not record.limits["warm"].cold and record.limits["cold"].cold  # each its own copy
    assert record.fusion is not None and record.fusion.device_ops == 1
    # What the harness cost, and where: every phase once, within the trial's own wall time.
    assert 0 < record.trial_s <= wall_s
    assert list(record.phases_s) == ["inputs, build, first call", "warm timing", "cold timing",
                                     "gate checks, copy limits", "profiler pass"]
    assert all(seconds > 0 for seconds in record.phases_s.values())
    assert sum(record.phases_s.values()) <= record.trial_s


def test_wrong_values_are_incorrect() -> None:
    record = _trial("test-off-by-eps")
    assert record.status is Status.INCORRECT and "max abs error" in record.message
    assert record.timing is None and record.gbps("cold") is None


def test_mutating_an_input_is_incorrect() -> None:
    record = _trial("test-mutates")
    assert record.status is Status.INCORRECT and "modified input 'weight'" in record.message


def test_output_aliasing_an_input_is_incorrect() -> None:
    record = _trial("test-aliases")
    assert record.status is Status.INCORRECT
    assert "modified" in record.message or "aliases" in record.message


def test_reusing_an_earlier_result_is_caught_in_the_timed_calls() -> None:
    """The cached answer is wrong for every other set (incorrect in a checked timed call); when
    the refill probe happens to change the cached set itself, it is the old values' answer
    (stale), and the probe says so. Either way the timing loop catches it."""
    record = _trial("test-caches")
    if record.status is Status.STALE_RESULT:
        assert "in the timing loop" in record.message and "input set 0" in record.message
    else:
        assert record.status is Status.INCORRECT and "in timed call" in record.message
    assert "max abs error" in record.message and record.timing is None


def test_exceptions_become_statuses() -> None:
    assert _trial("test-raises").status is Status.RUNTIME_ERROR
    failed_setup = _trial("test-setup-fails")
    assert failed_setup.status is Status.COMPILE_ERROR and "cannot build" in failed_setup.message
    wrong = _trial("test-wrong-dtype", dtype="bfloat16")
    assert wrong.status is Status.INCORRECT and "dtype" in wrong.message


def test_each_trial_counts_its_own_compiles() -> None:
    """Compile time belongs to the trial that paid it: the first torch.compile trial compiles
    its graph (or finds it in the on-disk cache a run before left), the second finds it there
    (each trial starts from a reset dynamo); an eager variant compiles nothing."""
    params = {"mode": "default", "dynamic": False}
    first, second = (_trial("compiled", params=params) for _ in range(2))
    eager = _trial("naive")
    assert first.status is second.status is eager.status is Status.PASSED
    assert sum(first.compiles.values()) == 1
    assert second.compiles == {"fxgraph_cache_miss": 0, "fxgraph_cache_hit": 1}
    assert eager.compiles == {"fxgraph_cache_miss": 0, "fxgraph_cache_hit": 0}


def test_record_round_trips_through_json() -> None:
    record = _trial("naive")
    import json

    from fusionlab.records import TrialRecord

    again = TrialRecord.from_dict(json.loads(record.to_json()))
    assert again == record

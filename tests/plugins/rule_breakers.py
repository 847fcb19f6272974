"""Variants (and two small ops) that each break one rule of the gate, and only that one, so a test
can show the rule is what catches them: take the rule away and the variant would pass.

`tests/test_gate_rules.py` runs every one through a real trial; the crashing and hanging ones run
in the isolated worker process, as a sweep runs them.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

from fusionlab import OpSpec, Tolerance, register_op, register_variant
from fusionlab.kernels.add_rmsnorm.framework import builtin_add_rmsnorm_
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

sys.path.append(str(Path(__file__).parent))  # the cheats' shared scaffolding sits beside this file
from cheat_kit import (
    by_pointer,
    cached_per,
    numpy_rmsnorm,
    patch_perf_counter,
    right_once_then,
    stealing_time,
)

CPU = ("cpu",)
# Scales x in place on later calls: RMSNorm of c*x is RMSNorm of x (eps aside), so every output
# stays right and only the input-set check can see the change. 1 + 2**-10 never overflows here.
_SCALE = 1.0 + 2.0**-10


def _copy_inputs(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator).to(device=device, dtype=dtype),)


def _copy_reference(inputs):
    return (inputs[0].double().cpu(),)


def _copy_op(name: str, claimed_factor: int) -> OpSpec:
    """y = x: the op where handing back the input is right in value and wrong in memory.
    `claimed_factor` > 1 makes the spec claim more bytes than a copy moves."""
    return register_op(OpSpec(
        name=name,
        description="y = a fresh copy of x" + (" (claims too many bytes)" if claimed_factor > 1
                                               else ""),
        inputs=("x",),
        outputs=("y",),
        make_inputs=_copy_inputs,
        reference=_copy_reference,
        bytes_moved=lambda shape, dtype: claimed_factor * 2 * math.prod(shape) * dtype.itemsize,
        tolerance=lambda dtype: Tolerance(0.0, 0.0),
        baseline="clone",
        builtin="clone",
        default_shapes="64x256",
        quick_shapes="64x256",
    ))


_copy_op("rbcopy", 1)
# An honest clone measured against a spec that claims 10 000x the bytes: its bandwidth is then
# far beyond what the device can copy, the case the copy-bandwidth rule exists for.
_copy_op("rbcopy_overclaimed", 10_000)


def _clone(device_type: str):
    return lambda x: x.clone()


register_variant("rbcopy", "clone", devices=CPU, kind="baseline")(_clone)
register_variant("rbcopy_overclaimed", "clone", devices=CPU, kind="baseline")(_clone)


@register_variant("rbcopy", "rb-returns-input", devices=CPU)
def returns_input(device_type: str):
    """Right values, input untouched, but the output is the input's own memory."""
    return lambda x: x


@register_variant("rmsnorm", "rb-off-by-eps", devices=CPU)
def off_by_eps(device_type: str):
    """Wrong values on every call (eps of 0.1)."""
    return lambda x, weight, eps: naive_rmsnorm(x, weight, 1e-1)


@register_variant("rmsnorm", "rb-wrong-after-first", devices=CPU)
def wrong_after_first(device_type: str):
    """Right on the first call, then off by half in fresh memory: only timed calls show it."""
    calls = itertools.count()

    def kernel(x, weight, eps):
        out = naive_rmsnorm(x, weight, eps)
        return out if next(calls) == 0 else out * 1.5

    return kernel


@register_variant("rmsnorm", "rb-mutates-weight", devices=CPU)
def mutates_weight(device_type: str):
    """Right answer, but the first call scales the weight it was given."""

    def kernel(x, weight, eps):
        out = naive_rmsnorm(x, weight, eps)
        weight.mul_(1.0001)
        return out

    return kernel


@register_variant("rmsnorm", "rb-scales-input-later", devices=CPU)
def scales_input_later(device_type: str):
    """Right answer on every call, but from the second call on it scales its x in place."""
    return right_once_then(lambda x: x.mul_(_SCALE), after=True)


@register_variant("rmsnorm", "rb-corrupts-input-later", devices=CPU)
def corrupts_input_later(device_type: str):
    """Right on the first call; from then on it negates its x after computing the answer."""
    return right_once_then(lambda x: x.neg_(), after=True)


@register_variant("rmsnorm", "rb-cache-by-pointer", devices=CPU)
def cache_by_pointer(device_type: str):
    """Computes once per input address and hands back a fresh copy of that result after."""
    return cached_per(by_pointer)


@register_variant("rmsnorm", "rb-cache-by-head", devices=CPU)
def cache_by_head(device_type: str):
    """Keys its cache on the input's address and its first few values: a change of every value
    recomputes, a change far from the start hands back the old answer."""
    return cached_per(lambda x: (x.data_ptr(), x.reshape(-1)[:8].numpy().tobytes()))


@register_variant("rmsnorm", "rb-garbage-after-refill", devices=CPU)
def garbage_after_refill(device_type: str):
    """Right on every input set as generated; when a tensor it has seen comes back with other
    values (same address), it hands back a wrong answer that is not the old one either."""
    seen: dict[int, float] = {}

    def kernel(x, weight, eps):
        key, total = x.data_ptr(), float(x.double().sum())
        if seen.setdefault(key, total) != total:
            return torch.full_like(x, 7.0)
        return naive_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "rb-static-buffer", devices=CPU)
def static_buffer(device_type: str):
    """Right values, written into one buffer it hands out on every call."""
    buffer: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        out = naive_rmsnorm(x, weight, eps)
        if not buffer:
            buffer.append(torch.empty_like(out))
        return buffer[0].copy_(out)

    return kernel


@register_variant("rmsnorm", "rb-raises-first", devices=CPU)
def raises_first(device_type: str):
    """Its first call raises a plain Python error."""

    def kernel(x, weight, eps):
        raise ValueError("kernel refuses")

    return kernel


@register_variant("rmsnorm", "rb-raises-later", devices=CPU)
def raises_later(device_type: str):
    """Right on the first call, raises on the fifth."""
    calls = itertools.count()

    def kernel(x, weight, eps):
        if next(calls) == 4:
            raise RuntimeError("kernel gave up on call 5")
        return naive_rmsnorm(x, weight, eps)

    return kernel


@register_variant("rmsnorm", "rb-setup-fails", devices=CPU)
def setup_fails(device_type: str):
    """The factory itself fails (a build that does not compile)."""
    raise RuntimeError("cannot build")


@register_variant("rmsnorm", "rb-graph-break-fullgraph", devices=CPU)
def graph_break_fullgraph(device_type: str):
    """torch.compile(fullgraph=True) of code with a graph break: the first call fails to compile."""

    def chain(x, weight, eps):
        h = x.float()
        torch._dynamo.graph_break()
        return naive_rmsnorm(h, weight, eps).to(x.dtype)

    return torch.compile(chain, fullgraph=True, backend="eager")


@register_variant("add_rmsnorm", "rb-inplace-wrong-later", devices=CPU,
                  inplace={"y": "x", "residual_out": "residual"})
def inplace_wrong_later(device_type: str):
    """In place as declared and right on its first call; later calls scale y by 1 + 2**-4: only
    the references taken just before each kept call (the inputs change every call) see it."""
    calls = itertools.count()

    def kernel(x, residual, weight, eps):
        y, total = builtin_add_rmsnorm_(x, residual, weight, eps)
        if next(calls):
            y.mul_(1.0 + 2.0**-4)
        return y, total

    return kernel


@register_variant("rmsnorm", "rb-stops-the-clock", devices=CPU)
def stops_the_clock(device_type: str):
    """Right values; replaces time.perf_counter (for good: restore it after the trial) so that
    60% of each call never shows on it."""
    return stealing_time(patch_perf_counter)


@register_variant("rmsnorm", "rb-numpy-hidden", devices=CPU, dtypes=("float32",))
def numpy_hidden(device_type: str):
    """Right values, computed in NumPy: no operator the profiler can see does the work."""
    return numpy_rmsnorm


@register_variant("rmsnorm", "rb-hangs-later", devices=CPU)
def hangs_later(device_type: str):
    """Right on the first call, then never returns."""
    return right_once_then(lambda x: time.sleep(3600))


@register_variant("rmsnorm", "rb-exits-later", devices=CPU)
def exits_later(device_type: str):
    """Right on the first call, then ends its process with exit code 3."""
    return right_once_then(lambda x: os._exit(3))

"""Adversarial RMSNorm variants: each does less work, or reuses memory, when called again, in a
way the gate must catch. Several per principle; none may ever be reported as fastest."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from fusionlab import register_variant
from fusionlab.kernels.rmsnorm.framework import naive_rmsnorm

sys.path.append(str(Path(__file__).parent))  # the cheats' shared scaffolding sits beside this file
from cheat_kit import by_pointer, cached_per, numpy_rmsnorm, recompute_every

CPU = ("cpu",)
# principle -> (variant, the status it must earn, or the statuses it may earn)
EXPECTED = {
    "timed outputs are checked": [
        ("game-skip-after-first", "incorrect"),
        # It hands back the last answer it computed: wrong for another set, or, where the refill
        # probe changed one value of the set it last computed, the answer to the old values.
        ("game-every-third-call", ("incorrect", "stale_result")),
        # Its rows after the first are the first call's: where only set 0's calls were checked,
        # the refill probe inside the loop (one value changed in a later row) gets the old answer.
        ("game-first-row-only", ("incorrect", "stale_result")),
    ],
    "fresh memory on every call": [
        ("game-static-buffer", "reused_memory"),
        ("game-ring-of-two", "reused_memory"),
        ("game-same-tensor-per-input", "reused_memory"),
    ],
    "in-place value changes give the new answer": [
        ("game-clone-per-pointer", "stale_result"),
        ("game-clone-per-pointer-and-version", "stale_result"),
        ("game-clone-per-sampled-content", "stale_result"),
    ],
    "work the profiler sees": [
        ("game-numpy-hidden", "suspicious"),
    ],
}


@register_variant("rmsnorm", "game-skip-after-first", devices=CPU)
def skip_after_first(device_type: str):
    """Correct once, then hands back uninitialised memory of the right shape."""
    calls = itertools.count()

    def kernel(x, weight, eps):
        return naive_rmsnorm(x, weight, eps) if next(calls) == 0 else torch.empty_like(x)

    return kernel


@register_variant("rmsnorm", "game-every-third-call", devices=CPU)
def every_third_call(device_type: str):
    """Batch-and-skip: computes one call in three, returns the last result otherwise."""
    return recompute_every(3)


@register_variant("rmsnorm", "game-first-row-only", devices=CPU)
def first_row_only(device_type: str):
    """Computes the first row each call and reuses the first call's other rows."""
    first: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        if not first:
            first.append(naive_rmsnorm(x, weight, eps))
        out = first[0].clone()
        out[..., :1, :] = naive_rmsnorm(x[..., :1, :], weight, eps)
        return out

    return kernel


@register_variant("rmsnorm", "game-static-buffer", devices=CPU)
def static_buffer(device_type: str):
    """Writes every result into one buffer and returns it (callers' earlier outputs change)."""
    buffers: dict[tuple[int, ...], torch.Tensor] = {}

    def kernel(x, weight, eps):
        out = buffers.setdefault(tuple(x.shape), torch.empty_like(x))
        return out.copy_(naive_rmsnorm(x, weight, eps))

    return kernel


@register_variant("rmsnorm", "game-ring-of-two", devices=CPU)
def ring_of_two(device_type: str):
    """Alternates between two preallocated buffers."""
    calls = itertools.count()
    buffers: list[torch.Tensor] = []

    def kernel(x, weight, eps):
        if not buffers:
            buffers.extend(torch.empty_like(x) for _ in range(2))
        return buffers[next(calls) % 2].copy_(naive_rmsnorm(x, weight, eps))

    return kernel


@register_variant("rmsnorm", "game-same-tensor-per-input", devices=CPU)
def same_tensor_per_input(device_type: str):
    """Computes once per input tensor and hands back the same output tensor (the issue's case)."""
    return cached_per(by_pointer, clone=False)


@register_variant("rmsnorm", "game-clone-per-pointer", devices=CPU)
def clone_per_pointer(device_type: str):
    """Computes once per input address, then returns a fresh copy of that result."""
    return cached_per(by_pointer)


@register_variant("rmsnorm", "game-clone-per-pointer-and-version", devices=CPU)
def clone_per_pointer_and_version(device_type: str):
    """As above, but recomputes when the tensor's version counter moves."""
    return cached_per(lambda x: (x.data_ptr(), x._version))


@register_variant("rmsnorm", "game-clone-per-sampled-content", devices=CPU)
def clone_per_sampled_content(device_type: str):
    """Keys its cache on the first 16 values: reads almost nothing, reuses everything."""
    return cached_per(lambda x: (tuple(x.shape), tuple(x.reshape(-1)[:16].tolist())))


@register_variant("rmsnorm", "game-numpy-hidden", devices=CPU, dtypes=("float32",))
def numpy_hidden(device_type: str):
    """Correct, but computed in NumPy: no operator the profiler can see does the work."""
    return numpy_rmsnorm

"""Predict a patch's end-to-end saving from the calls the model makes.

Inference steps are timed in situ: a clock read around every captured norm module's forward
(module hooks) while the whole step runs, unpatched and patched in alternating runs, so each
call pays what it pays inside the model (cold caches after the matmuls, the allocator's state,
the module call). Training steps call each module as the model calls it (`module(x)` and its
backward to the input and the module's parameters) at its captured key, in paired interleaved
rounds; modules of one class at one key with one chosen variant are timed once, on one of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fusionlab.measure.limits import mean_call_s
from fusionlab.shapes import DTYPES

if TYPE_CHECKING:
    from fusionlab.model.models import Step
    from fusionlab.model.patch_handle import PatchedModel

_SAMPLE_S = 0.002  # wall time of one sample: enough calls that the clock's cost vanishes


@dataclass(frozen=True)
class CallTiming:
    """One group of a step's norm calls: how many per step, and one call's time both ways."""

    module_class: str
    key: str
    variant: str  # the chosen variant, or "(module's own)"
    calls: int  # per step, over every module of the group
    own_us: float  # median time of one call of the module's own forward
    patched_us: float  # median time of one call of the patched forward
    saving_us: float  # median of the paired per-round differences (own - patched)


def time_calls(handle: PatchedModel, step: str, rounds: int = 15,
               train: bool = False) -> list[CallTiming]:
    """Time every group of the step's captured module calls, unpatched and patched, in `rounds`
    paired rounds (the order alternates each round), forward only or with `train` forward and
    backward; the handle is left patched."""
    groups = _groups(handle, step)
    own: dict[tuple[str, str, str], list[float]] = {g: [] for g in groups}
    patched: dict[tuple[str, str, str], list[float]] = {g: [] for g in groups}
    bind = _bound_training_call if train else _bound_call
    calls = {g: bind(module, x) for g, (module, x, _) in groups.items()}
    with torch.set_grad_enabled(train):
        loops = {g: _loops(call) for g, call in calls.items()}
        for round_index in range(rounds):
            order = [(handle.undo, own), (handle.redo, patched)]
            for switch, samples in order[::-1] if round_index % 2 else order:
                switch()
                for group, call in calls.items():
                    samples[group].append(mean_call_s(call, _sync, loops[group]))
    handle.redo()
    return [
        CallTiming(*group, count, 1e6 * statistics.median(own[group]),
                   1e6 * statistics.median(patched[group]),
                   1e6 * statistics.median(a - b for a, b in zip(own[group], patched[group],
                                                                 strict=True)))
        for group, (_, _, count) in groups.items()
    ]


def time_in_situ(handle: PatchedModel, step: Step, rounds: int = 15) -> list[CallTiming]:
    """Time every group of the step's captured module calls inside `rounds` runs of the whole
    step each way (unpatched and patched alternate, the order flipping every round, as the
    step itself is timed); a call's time runs from its forward pre-hook to its forward hook.
    Gradients off; the handle is left patched."""
    groups = _path_groups(handle, step.name)
    own: dict[tuple[str, str, str], list[float]] = {g: [] for g in set(groups.values())}
    patched: dict[tuple[str, str, str], list[float]] = {g: [] for g in own}
    counts: dict[tuple[str, str, str], int] = dict.fromkeys(own, 0)
    durations: list[tuple[str, float]] = []
    hooks = _clock_hooks(handle, groups, durations)
    try:
        with torch.no_grad():
            for round_index in range(rounds + 1):  # round 0 warms both ways up, uncounted
                order = [(handle.undo, own), (handle.redo, patched)]
                for switch, samples in order[::-1] if round_index % 2 else order:
                    switch()
                    durations.clear()
                    step.run()
                    _sync()
                    if round_index:
                        _add_round(samples, counts, groups, durations)
    finally:
        for hook in hooks:
            hook.remove()
        handle.redo()
    return [
        CallTiming(*group, counts[group] // (2 * rounds),
                   1e6 * statistics.median(own[group]), 1e6 * statistics.median(patched[group]),
                   1e6 * statistics.median(a - b for a, b in zip(own[group], patched[group],
                                                                 strict=True)))
        for group in own if own[group]
    ]


def _path_groups(handle: PatchedModel, step: str) -> dict[str, tuple[str, str, str]]:
    """Module path -> (class, key, variant) for the step's captured module calls."""
    variants = {(row.path, row.key): row.variant for row in handle.rows}
    return {
        call.path: (call.module_class, call.key,
                    variants.get((call.path, call.key), "(unpatched)"))
        for call in handle.capture.calls if call.step == step and call.source == "module"
    }


def _clock_hooks(handle: PatchedModel, groups: dict[str, tuple[str, str, str]],
                 durations: list[tuple[str, float]]) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward pre-hooks and hooks that append (path, seconds) for every call of the modules."""
    starts: dict[str, float] = {}
    hooks = []
    for path in groups:
        module = handle.model.get_submodule(path)

        def before(_module: nn.Module, _args: object, path: str = path) -> None:
            _sync()
            starts[path] = time.perf_counter()

        def after(_module: nn.Module, _args: object, _out: object, path: str = path) -> None:
            _sync()
            durations.append((path, time.perf_counter() - starts[path]))

        hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    return hooks


def _add_round(samples: dict[tuple[str, str, str], list[float]],
               counts: dict[tuple[str, str, str], int], groups: dict[str, tuple[str, str, str]],
               durations: list[tuple[str, float]]) -> None:
    """One run's durations as each group's mean seconds per call."""
    totals: dict[tuple[str, str, str], list[float]] = {}
    for path, seconds in durations:
        totals.setdefault(groups[path], []).append(seconds)
    for group, times in totals.items():
        samples[group].append(sum(times) / len(times))
        counts[group] += len(times)


def _groups(handle: PatchedModel, step: str
            ) -> dict[tuple[str, str, str], tuple[nn.Module, torch.Tensor, int]]:
    """(class, key, variant) -> one of its modules, an input at the key, and the step's calls."""
    variants = {(row.path, row.key): row.variant for row in handle.rows}
    groups: dict[tuple[str, str, str], tuple[nn.Module, torch.Tensor, int]] = {}
    generator = torch.Generator().manual_seed(0)
    for call in handle.capture.calls:
        if call.step != step or call.source != "module":
            continue
        group = (call.module_class, call.key, variants.get((call.path, call.key), "(unpatched)"))
        if group in groups:
            module, x, count = groups[group]
            groups[group] = (module, x, count + call.calls)
            continue
        x = torch.randn(call.shape, generator=generator).to(DTYPES[call.dtype]).to(call.device)
        groups[group] = (handle.model.get_submodule(call.path), x, call.calls)
    return groups


def _bound_call(module: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    return lambda: module(x)


def _bound_training_call(module: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """module(x) and the gradients of its input and parameters from a fixed upstream gradient
    (returned, not accumulated into `.grad`)."""
    x = x.detach().requires_grad_()
    inputs = [x, *(p for p in module.parameters() if p.requires_grad)]
    generator = torch.Generator().manual_seed(1)
    upstream = torch.randn(x.shape, generator=generator).to(x.dtype).to(x.device)
    return lambda: torch.autograd.grad(module(x), inputs, upstream)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _loops(call: Callable[[], object]) -> int:
    """Calls per sample so that one sample takes about _SAMPLE_S (after warm-up calls)."""
    for _ in range(3):
        call()
    once = mean_call_s(call, _sync, 3)
    return max(3, min(10_000, int(_SAMPLE_S / max(once, 1e-9))))

"""Predict a patch's end-to-end saving from the calls the model makes: each captured norm module
is called as the model calls it (`module(x)`: the module call, the patched table lookup, the
kernel) at its captured keys, its own forward against the patched one in paired interleaved
rounds (for a training step: the call and its backward to the input and the module's
parameters). Modules of one class at one key with one chosen variant are timed once, on one of
them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fusionlab.shapes import DTYPES

if TYPE_CHECKING:
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
                    samples[group].append(_per_call_s(call, loops[group]))
    handle.redo()
    return [
        CallTiming(*group, count, 1e6 * statistics.median(own[group]),
                   1e6 * statistics.median(patched[group]),
                   1e6 * statistics.median(a - b for a, b in zip(own[group], patched[group],
                                                                 strict=True)))
        for group, (_, _, count) in groups.items()
    ]


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
    once = _per_call_s(call, 3)
    return max(3, min(10_000, int(_SAMPLE_S / max(once, 1e-9))))


def _per_call_s(call: Callable[[], object], loops: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(loops):
        call()
    _sync()
    return (time.perf_counter() - start) / loops

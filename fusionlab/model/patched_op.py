"""The op a patched norm module calls inside a torch.compile graph.

Dynamo treats a torch.library custom op as opaque: the graph holds one call of
`fusionlab::patched_norm(x, slot)` per module, and its real kernel looks the module's kernel up
for the real input's key at run time (resolving a new key once, eagerly). A new sequence length
therefore needs no retrace, and the resolution's Python (dictionaries, warnings, the check against
the module) never enters the graph. The fake kernel gives the output's shape and dtype."""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


class Runnable(Protocol):
    """What a slot holds: a patched module's eager call and its own forward."""

    def run(self, x: torch.Tensor) -> torch.Tensor: ...

    def original(self, x: torch.Tensor) -> torch.Tensor: ...


# Weak: a patched forward holds its module's entry, so an entry lives while anything calls it.
_SLOTS: list[weakref.ref[Runnable]] = []
_OUTPUT_DTYPES: dict[tuple[int, torch.dtype], torch.dtype] = {}


def register(module: Runnable) -> int:
    """A slot number for a patched module (never reused: compiled graphs name it)."""
    _SLOTS.append(weakref.ref(module))
    return len(_SLOTS) - 1


def _module(slot: int) -> Runnable:
    module = _SLOTS[slot]()
    assert module is not None, "a compiled graph calls a patched module that no longer exists"
    return module


@torch.library.custom_op("fusionlab::patched_norm", mutates_args=())
def patched_norm(x: torch.Tensor, slot: int) -> torch.Tensor:
    """The patched module in `slot` applied to x: its kernel for x's key, or its own forward."""
    out = _module(slot).run(x).contiguous()
    return out.clone() if out.data_ptr() == x.data_ptr() else out


@patched_norm.register_fake
def _patched_norm_fake(x: torch.Tensor, slot: int) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=output_dtype(slot, x))


def output_dtype(slot: int, x: torch.Tensor) -> torch.dtype:
    """The module's output dtype for x's dtype (a kernel is only used where they agree): its own
    forward run once on one real row."""
    key = (slot, x.dtype)
    if key not in _OUTPUT_DTYPES:
        with unset_fake_temporarily(), torch.no_grad():
            row = torch.zeros(1, x.shape[-1], dtype=x.dtype, device=x.device)
            _OUTPUT_DTYPES[key] = _module(slot).original(row).dtype
    return _OUTPUT_DTYPES[key]

"""The ops a patched model calls inside a torch.compile graph.

Dynamo treats a torch.library custom op as opaque: the graph holds one call of
`fusionlab::patched_norm(x, slot)` per module (and one `fusionlab::patched_add_norm(x, residual,
slot)` per fused decoder layer), and its real kernel looks the kernel up for the real input's key
at run time (resolving a new key once, eagerly). A new sequence length therefore needs no
retrace, and the resolution's Python (dictionaries, warnings, the check against the module) never
enters the graph. The fake kernels give the outputs' shapes and dtypes."""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


class Runnable(Protocol):
    """What a slot holds: a patched module's eager call and its own forward."""

    def run(self, x: torch.Tensor) -> torch.Tensor: ...

    def original(self, x: torch.Tensor) -> torch.Tensor: ...


class PairRunnable(Protocol):
    """What a fused layer's slot holds: its eager add + norm call and the layer's own."""

    def run(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def original(self, x: torch.Tensor,
                 residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# Weak: a patched forward holds its module's entry, so an entry lives while anything calls it.
_SLOTS: list[weakref.ref[Any]] = []
_OUTPUT_DTYPES: dict[tuple[int, torch.dtype], torch.dtype] = {}


def register(module: Runnable | PairRunnable) -> int:
    """A slot number for a patched module or fused layer (never reused: compiled graphs name it)."""
    _SLOTS.append(weakref.ref(module))
    return len(_SLOTS) - 1


def _module(slot: int) -> Any:
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


@torch.library.custom_op("fusionlab::patched_add_norm", mutates_args=())
def patched_add_norm(x: torch.Tensor, residual: torch.Tensor,
                     slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused layer in `slot` applied to (x, residual): (norm(x + residual), x + residual) by
    its kernel for x's key, or by the layer's own add and norm."""
    y, total = _module(slot).run(x, residual)
    y, total = y.contiguous(), total.contiguous()
    inputs = {x.data_ptr(), residual.data_ptr()}  # a custom op's outputs may not alias
    y = y.clone() if y.data_ptr() in inputs else y
    taken = inputs | {y.data_ptr()}
    return y, total.clone() if total.data_ptr() in taken else total


@patched_add_norm.register_fake
def _patched_add_norm_fake(x: torch.Tensor, residual: torch.Tensor,
                           slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    y_dtype, sum_dtype = pair_dtypes(slot, x, residual)
    return x.new_empty(x.shape, dtype=y_dtype), x.new_empty(x.shape, dtype=sum_dtype)


_PAIR_DTYPES: dict[tuple[int, torch.dtype, torch.dtype], tuple[torch.dtype, torch.dtype]] = {}


def pair_dtypes(slot: int, x: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The layer's (norm output, sum) dtypes for these input dtypes: its own add and norm run
    once on one real row."""
    key = (slot, x.dtype, residual.dtype)
    if key not in _PAIR_DTYPES:
        with unset_fake_temporarily(), torch.no_grad():
            row = torch.zeros(1, x.shape[-1], dtype=x.dtype, device=x.device)
            y, total = _module(slot).original(row, row.to(residual.dtype))
            _PAIR_DTYPES[key] = (y.dtype, total.dtype)
    return _PAIR_DTYPES[key]

"""The refill probe inside the timing loop: one value of an input set changed between two samples.

After a sample drawn from the operating system's entropy (`timing.draw`), untimed and after the
fact like the choice of a checked call, one element at a drawn place of the first input of the
set the next sample starts on gets a new value; the next sample's first call (on that set) is
checked against the float64 reference of the changed values (for a row-wise op, its changed
row against that row's reference: one row's work), and the element is restored after that
sample. A cache that waits for the refill check after the loops, or keys its results by a
tag or a few sampled elements, hands back the answer to the old values: `stale_result`. Only for
variants that write no input (their sets stay as generated) and not on the flush path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fusionlab.measure.inputs import tensors_in
from fusionlab.measure.timing import draw
from fusionlab.op import Inputs, OpSpec


class Probe:
    """Changes one value of a loop's input set and restores it (`timing.Alteration`)."""

    def __init__(self, sets: list[Inputs]) -> None:
        self._sets = sets
        self.index = -1  # the set changed, -1 while none was
        self.position = -1  # the flat index changed in its first input tensor
        self._old: torch.Tensor | None = None

    def _flat(self, index: int) -> torch.Tensor | None:
        first = tensors_in(self._sets[index])[0]
        return first.data.view(-1) if first.is_contiguous() and first.numel() > 0 else None

    def alter(self, index: int) -> None:
        """Give one element, at a drawn place, of set `index`'s first input a new value."""
        flat = self._flat(index)
        if flat is None:
            return
        self.index, self.position = index, draw(flat.numel())
        self._old = flat[self.position].clone()
        flat[self.position] = self._old * -2 + 1

    def restore(self) -> None:
        """Put the changed element back as generated."""
        if self._old is not None:
            self._flat(self.index)[self.position] = self._old  # type: ignore[index]

    def altered(self) -> Inputs:
        """A copy of the changed set with the new value in it (for its reference)."""
        copied = tuple(t.clone() if isinstance(t, torch.Tensor) else t
                       for t in self._sets[self.index])
        flat = tensors_in(copied)[0].view(-1)
        flat[self.position] = self._old * -2 + 1  # type: ignore[operator]
        return copied

    def reference(self, spec: OpSpec,
                  base: Callable[[int], tuple[torch.Tensor, ...]]) -> ChangedReference:
        """The float64 reference of the changed set. For a row-wise op (`OpSpec.rowwise`) the
        changed row's reference before and after the change (one row's work), and the whole set's
        only when a whole output is checked: the set's own cached reference (`base(index)`) with
        that row swapped in; otherwise computed whole."""
        x = tensors_in(self._sets[self.index])[0]

        def altered() -> tuple[torch.Tensor, ...]:
            return spec.reference(self.altered())

        if not spec.rowwise or x.dim() < 2:
            return ChangedReference(altered)
        hidden = x.shape[-1]
        row = self.position // hidden
        before = tuple(t.reshape(-1, hidden)[row:row + 1].clone()
                       if isinstance(t, torch.Tensor) and t.shape == x.shape else t
                       for t in self._sets[self.index])
        after = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in before)
        changed = tensors_in(after)[0].view(-1)
        changed[self.position % hidden] = self._old * -2 + 1  # type: ignore[operator]
        return ChangedReference(altered, functools.partial(base, self.index), tuple(x.shape), row,
                                spec.reference(after), spec.reference(before))


@dataclass(frozen=True)
class ChangedReference:
    """The reference of a set the probe changed: `altered()` computes it whole; for a row-wise
    op `cached()` is the set's own cached reference, into which `rows` (the changed row's
    reference, [1, hidden] each) is swapped while it is read, and `old_rows` is that row's
    reference before the change."""

    altered: Callable[[], tuple[torch.Tensor, ...]]
    cached: Callable[[], tuple[torch.Tensor, ...]] | None = None
    shape: tuple[int, ...] = ()
    row: int = -1
    rows: tuple[torch.Tensor, ...] = ()
    old_rows: tuple[torch.Tensor, ...] = ()

    def rows_of(self, outputs: Sequence[object]) -> tuple[torch.Tensor, ...] | None:
        """Copies of the changed row of every output, when each is a plain tensor of the
        input's shape (else None: the whole is checked)."""
        if not self.rows or not all(type(out) is torch.Tensor and out.layout is torch.strided
                                    and tuple(out.shape) == self.shape for out in outputs):
            return None
        hidden = self.shape[-1]
        return tuple(out.reshape(-1, hidden)[self.row:self.row + 1].clone()  # type: ignore[union-attr]
                     for out in outputs)

    @contextmanager
    def swapped(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """The changed set's whole reference, valid inside the block (a cached one is restored
        after it)."""
        whole = self.cached() if self.cached is not None else ()
        if not whole or any(tuple(out.shape) != self.shape for out in whole):
            yield self.altered()
            return
        views = [out.view(-1, out.shape[-1])[self.row] for out in whole]
        kept = [view.clone() for view in views]
        try:
            for view, new in zip(views, self.rows, strict=True):
                view.copy_(new.reshape(-1))
            yield whole
        finally:
            for view, old in zip(views, kept, strict=True):
                view.copy_(old)

"""The refill probe inside the timing loop: one value of an input set changed between two samples.

After a sample drawn from the operating system's entropy (`timing.draw`), untimed and after the
fact like the choice of a checked call, one element at a drawn place of the first input of the
set the next sample starts on gets a new value; the next sample's first call (on that set) is
checked against the float64 reference of the changed values, and the element is restored after
that sample. A cache that waits for the refill check after the loops, or keys its results by a
tag or a few sampled elements, hands back the answer to the old values: `stale_result`. Only for
variants that write no input (their sets stay as generated) and not on the flush path.
"""

from __future__ import annotations

from collections.abc import Callable

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
                  base: Callable[[int], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """The float64 reference of the changed set. For a row-wise op (`OpSpec.rowwise`) the
        set's own reference (`base(index)`, cached by the input sets) with the changed row
        recomputed: one row's work instead of the whole set's; otherwise computed whole."""
        x = tensors_in(self._sets[self.index])[0]
        if not spec.rowwise or x.dim() < 2:
            return spec.reference(self.altered())
        hidden = x.shape[-1]
        row = self.position // hidden
        inputs = tuple(t.reshape(-1, hidden)[row:row + 1].clone()
                       if isinstance(t, torch.Tensor) and t.shape == x.shape else t
                       for t in self._sets[self.index])
        tensors_in(inputs)[0].view(-1)[self.position % hidden] = self._old * -2 + 1  # type: ignore[operator]
        whole = base(self.index)
        if any(out.shape != x.shape for out in whole):
            return spec.reference(self.altered())
        outputs = []
        for out, new_row in zip(whole, spec.reference(inputs), strict=True):
            out = out.clone()
            out.view(-1, hidden)[row] = new_row.reshape(hidden)
            outputs.append(out)
        return tuple(outputs)

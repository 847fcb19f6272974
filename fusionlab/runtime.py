"""Use the winners at runtime: dispatch each call to the fastest passing variant for its key."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fusionlab.api import stored_cells
from fusionlab.devices import Device
from fusionlab.registry import Kernel, get_op, get_variant
from fusionlab.results import CellResult
from fusionlab.search.storage import DEFAULT_STORAGE
from fusionlab.shapes import DTYPES


@dataclass(frozen=True)
class Choice:
    """What a key dispatches to and why (`exact`, `nearest`, or `fallback`)."""

    variant: str
    params: dict[str, Any]
    match: str


class Dispatcher:
    """Callable with the op's inputs; builds each chosen kernel once and reuses it."""

    def __init__(self, op: str, storage: str = DEFAULT_STORAGE) -> None:
        self.spec = get_op(op)
        self._cells: dict[tuple[str, str], list[CellResult]] = {}
        for cell in stored_cells(op, storage):
            if cell.ranked():
                self._cells.setdefault((cell.device_name, cell.dtype), []).append(cell)
        self._kernels: dict[tuple[Any, ...], Kernel] = {}
        self._device_names: dict[str, str] = {}

    def choose(self, shape: tuple[int, ...], dtype: torch.dtype, device_type: str) -> Choice:
        """Exact key first; else the same hidden size with the nearest row count; else fallback."""
        if device_type not in self._device_names:
            self._device_names[device_type] = Device(device_type).hardware_name()
        dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
        cells = self._cells.get((self._device_names[device_type], dtype_name), [])
        exact = [c for c in cells if c.shape == shape]
        if exact:
            return self._winner(exact[0], "exact")
        rows = math.prod(shape[:-1])
        same_hidden = [c for c in cells if c.shape[-1] == shape[-1]]
        if same_hidden:
            nearest = min(same_hidden, key=lambda c: abs(math.log(math.prod(c.shape[:-1]) / rows)))
            return self._winner(nearest, "nearest")
        return Choice(self.spec.default_variant, {}, "fallback")

    @staticmethod
    def _winner(cell: CellResult, match: str) -> Choice:
        best = cell.ranked()[0]
        return Choice(best.variant, dict(best.params), match)

    def __call__(self, *inputs: object) -> torch.Tensor:
        shape, dtype = self.spec.key_of(inputs)
        first = inputs[0]
        assert isinstance(first, torch.Tensor)
        key = (shape, dtype, first.device.type)
        kernel = self._kernels.get(key)
        if kernel is None:
            choice = self.choose(shape, dtype, first.device.type)
            variant = get_variant(self.spec.name, choice.variant)
            kernel = variant.factory(first.device.type, **choice.params)
            self._kernels[key] = kernel
        return kernel(*inputs)

"""A cell: the one value that says where a measurement belongs.

Runner, worker, records, results, study names and the Dispatcher all use this value; results of
different hardware or toolchains never share a cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fusionlab.op import Shape
from fusionlab.schema import Stored, parse
from fusionlab.shapes import format_shape


def device_label(device_name: str, threads: int, allocator: str) -> str:
    """`name (N threads), malloc SETTING`, each part where it applies."""
    label = f"{device_name} ({threads} threads)" if threads else device_name
    return f"{label}, malloc {allocator}" if allocator else label


@dataclass(frozen=True)
class Cell(Stored):
    """(op, device, hardware, toolchain, shape, dtype) and, on the CPU, the thread count the
    op ran with (0 elsewhere: a GPU or NeuronCore kernel does not depend on host threads) and
    the host allocator setting (measure/allocator.py; "" elsewhere or when not recorded), and
    the pass measured (measure/passes.py: forward, backward or forward+backward)."""

    op: str
    device: str
    device_name: str
    shape: Shape
    dtype: str
    toolchain_id: str = ""
    toolchain: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    threads: int = 0
    allocator: str = ""
    pass_name: str = "forward"

    @property
    def label(self) -> str:
        label = f"{format_shape(self.shape)} {self.dtype}"
        return label if self.pass_name == "forward" else f"{label} {self.pass_name}"

    @property
    def device_label(self) -> str:
        """The hardware, with the thread count and allocator where they are part of the cell."""
        return device_label(self.device_name, self.threads, self.allocator)

    @classmethod
    def from_dict(cls, data: Any) -> Cell:
        """A cell's attribute carries no schema version: fields it does not know are dropped."""
        return parse(cls, data, strict=False)

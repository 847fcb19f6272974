"""A cell: the one value that says where a measurement belongs.

Runner, worker, records, results, study names and the Dispatcher all use this value; results of
different hardware or toolchains never share a cell.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fusionlab.op import Shape
from fusionlab.shapes import format_shape


def device_label(device_name: str, threads: int, allocator: str) -> str:
    """`name (N threads), malloc SETTING`, each part where it applies."""
    label = f"{device_name} ({threads} threads)" if threads else device_name
    return f"{label}, malloc {allocator}" if allocator else label


@dataclass(frozen=True)
class Cell:
    """(op, device, hardware, toolchain, shape, dtype) and, on the CPU, the thread count the
    op ran with (0 elsewhere: a GPU or NeuronCore kernel does not depend on host threads) and
    the host allocator setting (measure/allocator.py; "" elsewhere or when not recorded)."""

    op: str
    device: str
    device_name: str
    shape: Shape
    dtype: str
    toolchain_id: str = ""
    toolchain: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    threads: int = 0
    allocator: str = ""

    @property
    def label(self) -> str:
        return f"{format_shape(self.shape)} {self.dtype}"

    @property
    def device_label(self) -> str:
        """The hardware, with the thread count and allocator where they are part of the cell."""
        return device_label(self.device_name, self.threads, self.allocator)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        return cls(
            op=data["op"],
            device=data["device"],
            device_name=data["device_name"],
            shape=tuple(data["shape"]),
            dtype=data["dtype"],
            toolchain_id=data.get("toolchain_id", ""),
            toolchain=dict(data.get("toolchain", {})),
            threads=int(data.get("threads", 0)),
            allocator=data.get("allocator", ""),
        )

"""Plain, serialisable result records shared by the runner, the tables and the exports."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    """How a trial ended; only PASSED results can ever be reported as fastest."""

    PASSED = "passed"
    INCORRECT = "incorrect"
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"


@dataclass
class Timing:
    """Per-call latency in ms from many synchronised samples; raw samples kept."""

    first_call_ms: float
    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    cv: float
    calls_per_sample: int
    samples_ms: list[float]

    @property
    def relative_iqr(self) -> float:
        return (self.q3_ms - self.q1_ms) / self.median_ms if self.median_ms > 0 else 0.0


@dataclass
class Fusion:
    """Fusion accounting for one call, read off the profiler's events (medians over calls)."""

    source: str
    device_ops: float
    device_time_us: float | None
    span_us: float | None
    idle_us: float | None
    idle_share: float | None
    top_op: str
    top_op_share: float
    host_us: float
    memory_bytes: float
    nested_ops: float
    op_counts: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class Accuracy:
    """Worst error against the float64 reference and the tolerance it was held to."""

    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float


@dataclass
class TrialRecord:
    """One measured (variant, params) at one (op, device, shape, dtype)."""

    op: str
    variant: str
    params: dict[str, Any]
    device: str
    device_name: str
    shape: list[int]
    dtype: str
    status: Status
    message: str = ""
    setup_ms: float | None = None
    timing: Timing | None = None
    fusion: Fusion | None = None
    accuracy: Accuracy | None = None
    bytes_moved: int = 0
    torch_version: str = ""
    seed: int = 0
    profile_table: str = ""
    trace_file: str = ""

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED and self.timing is not None

    @property
    def gbps(self) -> float | None:
        """Achieved bandwidth of the bytes the op must move, in GB/s."""
        if not self.passed or self.timing is None:
            return None
        return self.bytes_moved / (self.timing.median_ms * 1e-3) / 1e9

    def config_label(self) -> str:
        """`variant(k=v, ...)` for progress lines and tables."""
        inner = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.variant}({inner})" if inner else self.variant

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRecord:
        data = dict(data)
        data["status"] = Status(data["status"])
        for name, kind in (("timing", Timing), ("fusion", Fusion), ("accuracy", Accuracy)):
            if data.get(name) is not None:
                data[name] = kind(**data[name])
        return cls(**data)

"""Trial records: what one measured (variant, params) gave, in the result schema (schema.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fusionlab.cell import Cell
from fusionlab.schema import Stored, Versioned


class Status(str, Enum):
    """How a trial ended; only PASSED results can ever be reported as fastest."""

    PASSED = "passed"
    INCORRECT = "incorrect"  # wrong values anywhere, timed calls included; undeclared mutation
    STALE_RESULT = "stale_result"  # an input changed in place and the answer did not follow
    REUSED_MEMORY = "reused_memory"  # output storage handed out again, or aliasing an input
    SUSPICIOUS = "suspicious"  # faster than the device can move the bytes, or no device work
    INCONSISTENT = "inconsistent"  # audited much slower than the latency its decision used
    UNJUDGED = "unjudged"  # too fast for a busy copy limit, and no quiet limit stored to judge by
    UNSUPPORTED = "unsupported"  # the pass asks for a backward the variant does not have
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"


RANK_MODES = ("cold", "warm")


@dataclass
class Timing(Stored):
    """Per-call latency in ms from many synchronised samples; raw samples kept."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    cv: float
    calls_per_sample: int
    samples_ms: list[float]
    input_sets: int = 1  # how many input sets the calls rotated over
    working_set_bytes: int = 0

    @property
    def relative_iqr(self) -> float:
        return (self.q3_ms - self.q1_ms) / self.median_ms if self.median_ms > 0 else 0.0


@dataclass
class PassMemory(Stored):
    """Memory of a backward pass, in bytes (measure/pass_memory.py): the tensors autograd saved
    between forward and backward (distinct storages, inputs among them), and the most bytes
    torch's allocator had live beyond the start during the forward and during the backward."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int


@dataclass
class Fusion(Stored):
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
    # "device op": the device's own events (on the CPU, its outermost operator records);
    # "host op": an accelerator that gave the profiler no device events, so ops were counted on
    # the host and are never called device ops.
    unit: str = "device op"

    @property
    def counts_operator_records(self) -> bool:
        """Whether the units are operator records (with ATen ops nested inside them)."""
        return self.unit == "host op" or "operator records" in self.source


@dataclass
class Accuracy(Stored):
    """Worst error against the float64 reference and the tolerance it was held to."""

    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float
    checked_calls: int = 1


@dataclass
class CopyLimits(Stored):
    """Copy bandwidths (GB/s, read + write) of one (device, dtype, size) and how they were made:
    `clone` gets a fresh output (allocation included), `copy_` writes an existing buffer."""

    device_type: str
    dtype: str
    nbytes: int
    size_class: int
    clone_gbps: float
    copy_gbps: float
    cold: bool
    cold_achieved: bool
    buffers: int
    llc_bytes: int | None
    note: str = ""

    @property
    def limit_gbps(self) -> float:
        """The faster of the two copies: the most this device was seen to move at this size."""
        return max(self.clone_gbps, self.copy_gbps)


@dataclass
class BusyWindow(Stored):
    """What other processes did while a trial was timed (measure/disturbance.py): CPU seconds
    they used on its cores, their share of the window's capacity, the load average and clock at
    its end; `disturbed` above the busy share; `attempts`: timings taken (a disturbed one is
    taken again, the least disturbed kept)."""

    wall_s: float
    other_cpu_s: float
    other_share: float
    load: float
    mhz: float | None
    disturbed: bool
    attempts: int = 1


@dataclass
class TrialRecord(Versioned):
    """One measured (variant, params) in one cell."""

    noun = "trial record"

    cell: Cell
    variant: str
    params: dict[str, Any]
    status: Status
    message: str = ""
    setup_ms: float | None = None
    first_call_ms: float | None = None
    timing: Timing | None = None  # warm: a small rotation of input sets
    cold: Timing | None = None  # cache-cold: a rotation larger than the last-level cache
    cold_note: str = ""
    fusion: Fusion | None = None
    accuracy: Accuracy | None = None
    limits: dict[str, CopyLimits] = field(default_factory=dict)  # by rank mode
    bytes_moved: int = 0
    seed: int = 0
    trial_s: float = 0.0  # wall time inside the worker for this trial
    phases_s: dict[str, float] = field(default_factory=dict)  # where trial_s went
    # Inductor's FX graph cache in this trial: misses are real compiles, hits were found in the
    # on-disk cache that every worker of a host shares.
    compiles: dict[str, int] = field(default_factory=dict)
    # C++ extensions this trial's setup built (or waited for while another process built them),
    # in seconds: a one-time cost of the whole sweep, kept out of setup_ms and so out of first use.
    builds_s: dict[str, float] = field(default_factory=dict)
    # What other processes did while this trial was timed; None where unreadable (stored as {}).
    disturbance: BusyWindow | None = None
    profile_table: str = ""
    trace_file: str = ""
    memory: PassMemory | None = None  # the backward passes only

    @property
    def op(self) -> str:
        return self.cell.op

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cell.shape

    @property
    def dtype(self) -> str:
        return self.cell.dtype

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED and self.timing is not None

    @property
    def first_use_ms(self) -> float | None:
        """Setup plus first call: compile time lives here, never in latency. A C++ extension
        build is not a cell's cost (builds_s: it is paid once, for every cell after it)."""
        if self.first_call_ms is None:
            return None
        return (self.setup_ms or 0.0) + self.first_call_ms

    def timing_for(self, mode: str) -> Timing | None:
        """The timing a rank mode uses (cold falls back to warm when cold was not taken)."""
        return self.cold if mode == "cold" and self.cold is not None else self.timing

    def latency_ms(self, mode: str) -> float | None:
        timing = self.timing_for(mode)
        return timing.median_ms if timing is not None else None

    def gbps(self, mode: str) -> float | None:
        """Achieved bandwidth of the bytes the op must move, in GB/s."""
        latency = self.latency_ms(mode) if self.timing is not None else None
        return self.bytes_moved / (latency * 1e-3) / 1e9 if latency else None

    def limit_share(self, mode: str) -> dict[str, float] | None:
        """Achieved GB/s as a share of the same-run copy limits (fresh output, in place)."""
        limit, achieved = self.limits.get(mode), self.gbps(mode)
        if limit is None or achieved is None:
            return None
        return {"fresh": achieved / limit.clone_gbps, "inplace": achieved / limit.copy_gbps}

    def config_label(self) -> str:
        """`variant(k=v, ...)` for progress lines and tables."""
        inner = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.variant}({inner})" if inner else self.variant

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["disturbance"] = data["disturbance"] or {}  # no window: stored as it always was
        return data

    @classmethod
    def from_dict(cls, data: Any) -> TrialRecord:
        if isinstance(data, dict) and data.get("disturbance") == {}:
            data = {key: value for key, value in data.items() if key != "disturbance"}
        return super().from_dict(data)  # type: ignore[no-any-return]

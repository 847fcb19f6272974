"""One planning path for sweep, compare and profile: every input validated the same way, and
the configurations each cell will measure. Nothing is measured or stored here."""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import optuna.distributions as od
import torch

from fusionlab.cell import Cell, device_label
from fusionlab.devices import Device, get_device, resolve_device
from fusionlab.errors import UserError
from fusionlab.measure import allocator
from fusionlab.measure.passes import FORWARD, check_backward, check_pass
from fusionlab.measure.profiling import ProfilerSettings
from fusionlab.measure.rounds import StopRule
from fusionlab.measure.timing import TimingSettings
from fusionlab.op import OpSpec, Shape
from fusionlab.records import RANK_MODES
from fusionlab.registry import (
    Params,
    TunableSpace,
    Variant,
    get_op,
    load_entry_points,
    load_plugin,
    variants_of,
)
from fusionlab.schema import Versioned
from fusionlab.shapes import format_shape, parse_dtypes, parse_list, parse_shapes, torch_dtype
from fusionlab.toolchain import toolchain, toolchain_id

QUICK_DTYPES = "float32"
DEFAULT_DTYPES = "float32,bfloat16"
QUICK_TIMING = TimingSettings(warmup_s=0.02, budget_s=0.06, min_samples=7, max_samples=40)
QUICK_PROFILER = ProfilerSettings(wait=1, warmup=1, active=3)
# Copies the harness keeps per element of x: input sets, outputs held for checks, float64 refs.
_FLOAT64_COPIES = 6
_HELD_OUTPUTS = 8


@dataclass(frozen=True)
class Confirm:
    """How a cell's contenders are re-measured after the search (see verdict.py): in
    interleaved rounds until the cell is decided or its budget is spent (measure/rounds.py)."""

    rule: StopRule = field(default_factory=StopRule)  # its budget_s: one cell's rounds
    within: float = 0.10  # contenders: every variant's best within this of the fastest
    min_contenders: int = 2
    timing: TimingSettings = field(
        default_factory=lambda: TimingSettings(
            warmup_s=0.01, budget_s=0.04, min_samples=5, max_samples=25, checked_calls=1
        )
    )


@dataclass(frozen=True)
class SweepPlan:
    """What to sweep and how; built and validated by `make_plan`, which resolves the op once:
    the plan carries its spec and its registered variants down the sweep, not their names."""

    spec: OpSpec
    device: Device
    shapes: list[Shape]
    dtypes: list[str]
    registered: Mapping[str, Variant] = field(repr=False, compare=False)
    variants: list[str] | None = None
    trials: int = 40
    exhaustive_limit: int = 64
    fresh: bool = False
    timeout_s: float = 300.0
    seed: int = 0
    rank_by: str = "cold"
    calls: int | None = None  # rank by first use + calls x latency when set
    timing: TimingSettings = field(default_factory=TimingSettings)
    profiler: ProfilerSettings = field(default_factory=ProfilerSettings)
    confirm: Confirm | None = field(default_factory=Confirm)
    screen: bool = True  # a brief timing first; in full only what can still win (measure/screen)
    plugins: list[str] = field(default_factory=list)
    threads: int = 0  # the CPU's intra-op threads every trial runs with (0: not a CPU sweep)
    allocator: str = ""  # the CPU's host allocator setting (measure/allocator.py; "": not CPU)
    pass_name: str = FORWARD  # the pass every trial times (measure/passes.py)

    @property
    def device_label(self) -> str:
        """The hardware, with the thread count and allocator where they are part of the cells."""
        return device_label(self.device.hardware_name(), self.threads, self.allocator)

    @property
    def op(self) -> str:
        return self.spec.name

    def cell_variants(self, dtype: str) -> list[Variant]:
        """The variants that can run in a cell here (choice, availability, device and dtype), as
        this plan's pass sweeps them (`Variant.for_pass`)."""
        chosen = self.registered
        if self.variants is not None:
            chosen = {name: chosen[name] for name in self.variants}
        return [
            v.for_pass(self.pass_name != FORWARD)
            for v in chosen.values()
            if dtype in v.dtypes and v.unavailable_reason(self.device.type) is None
        ]

    def cells(self) -> list[Cell]:
        """Every (shape, dtype) cell that has a variant to run, keyed by the whole toolchain."""
        device_name = self.device.hardware_name()
        versions = toolchain(self.device, self.spec)
        result = []
        for shape in self.shapes:
            for dtype in self.dtypes:
                variants = self.cell_variants(dtype)
                if not variants:
                    continue
                result.append(
                    Cell(
                        self.op,
                        self.device.type,
                        device_name,
                        shape,
                        dtype,
                        toolchain_id(versions),
                        versions,
                        self.threads,
                        self.allocator,
                        self.pass_name,
                    )
                )
        return result


@dataclass(frozen=True)
class StoredPlan(Versioned):
    """A sweep plan as stored beside its cells: what a worker joining from another process or
    host needs to rebuild it (`plan()` validates it again on this host)."""

    noun: ClassVar[str] = "sweep plan"

    op: str
    device: str
    shapes: list[str]
    dtypes: list[str]
    variants: list[str] | None
    plugins: list[str]
    trials: int
    exhaustive_limit: int
    timeout_s: float
    seed: int
    rank_by: str
    calls: int | None
    timing: TimingSettings
    profiler: ProfilerSettings
    confirm: Confirm | None
    threads: int = 0  # 0: what torch uses on the joining host
    allocator: str = ""
    pass_name: str = FORWARD
    screen: bool = False

    @classmethod
    def of(cls, plan: SweepPlan) -> StoredPlan:
        """The plan as stored: the device by its type, shapes as text, plugins by absolute path;
        every other field as the plan holds it (the same names)."""
        stored = {
            "device": plan.device.type,
            "shapes": [format_shape(shape) for shape in plan.shapes],
            "dtypes": list(plan.dtypes),
            "plugins": [str(Path(path).resolve()) for path in plan.plugins],
        }
        return cls(**{f.name: stored[f.name] if f.name in stored else getattr(plan, f.name)
                      for f in fields(cls)})

    @classmethod
    def migrate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A version 1 plan's re-measurement held its stop rule's figures beside the others."""
        confirm = data.get("confirm")
        if isinstance(confirm, dict) and "rule" not in confirm:
            rule = {k: confirm[k] for k in ("min_rounds", "max_rounds", "budget_s") if k in confirm}
            data = {**data, "confirm": {**confirm, "rule": rule}}
        return data

    def plan(self) -> SweepPlan:
        """The plan this records, validated again here (this host's devices and plugins)."""
        plan = make_plan(
            self.op,
            ",".join(self.shapes),
            ",".join(self.dtypes),
            self.device,
            self.variants,
            self.plugins,
            trials=self.trials,
            timeout_s=self.timeout_s,
            seed=self.seed,
            rank_by=self.rank_by,
            calls=self.calls,
            threads=self.threads or None,
            allocator=self.allocator or None,
            pass_name=self.pass_name,
        )
        return replace(
            plan,
            exhaustive_limit=self.exhaustive_limit,
            timing=self.timing,
            profiler=self.profiler,
            confirm=self.confirm,
            screen=self.screen,
        )


def installed_toolchain(op: str, device_type: str) -> dict[str, str]:
    """The toolchain a new sweep of `op` on this device type would be keyed by."""
    return toolchain(get_device(device_type), get_op(op))


def load_user_variants(plugins: Sequence[str]) -> None:
    """Entry points first, then plugin files; any failure is a UserError."""
    load_entry_points()
    for path in plugins:
        load_plugin(path)


def check_fits(spec: OpSpec, shape: Shape, dtypes: Sequence[str], device: Device) -> None:
    """Refuse a shape whose tensors cannot fit, before anything runs."""
    free = device.available_memory()
    if free is None:
        return
    itemsize = max(torch_dtype(d).itemsize for d in dtypes)
    per_element = itemsize * (2 * len(spec.inputs) + _HELD_OUTPUTS * len(spec.outputs))
    per_element += 8 * _FLOAT64_COPIES * len(spec.outputs)
    needed = math.prod(shape) * per_element
    if needed > free:
        raise UserError(
            f"shape {format_shape(shape)} needs about {_human(needed)} of {device.type} memory "
            f"(input sets, outputs and float64 references) and {_human(free)} is available: "
            "choose a smaller shape"
        )


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} PiB"


def _positive(name: str, value: float | int | None) -> None:
    if value is not None and not value > 0:  # NaN is not > 0 either
        raise UserError(f"{name} must be greater than 0 (got {value:g})")


MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = 2**32 - 1 - 1024  # Optuna's samplers take seeds below 2**32; input set i uses seed + i


def check_timeout(value: float | None) -> None:
    """A trial timeout is a finite number of seconds, at most a week."""
    _positive("--timeout", value)
    if value is not None and not value <= MAX_TIMEOUT_S:
        raise UserError(f"--timeout must be at most {MAX_TIMEOUT_S:.0f} s, a week (got {value:g})")


def check_seed(value: int) -> None:
    """A seed every seeded component accepts."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise UserError(f"--seed must be an integer from 0 to {MAX_SEED} (got {value!r})")


def choose_variants(
    spec: OpSpec, known: Mapping[str, Variant], variants: str | Sequence[str] | None,
    device_type: str,
) -> list[str] | None:
    """The named variants among the op's `known` ones, checked to exist and to run on this
    device; None means all."""
    if variants is None:
        return None
    names = parse_list(variants, "--variants") if isinstance(variants, str) else list(variants)
    for name in names:
        if name not in known:
            raise UserError(
                f"unknown variant {name!r} of {spec.name}: choose from {', '.join(known)}"
            )
        reason = known[name].unavailable_reason(device_type)
        if reason:
            raise UserError(f"variant {name!r} cannot run on {device_type} here: {reason}")
    return list(dict.fromkeys(names))


def make_plan(
    op: str,
    shapes: str | None = None,
    dtypes: str | None = None,
    device: str = "auto",
    variants: str | Sequence[str] | None = None,
    plugins: Sequence[str] = (),
    quick: bool = False,
    **options: Any,
) -> SweepPlan:
    """Validate every input and return the plan; nothing is measured or stored yet."""
    load_user_variants(plugins)
    spec = get_op(op)
    shape_list = parse_shapes(shapes or (spec.quick_shapes if quick else spec.default_shapes))
    for shape in shape_list:
        problem = spec.check_shape(shape)
        if problem:
            raise UserError(f"shape {format_shape(shape)}: {problem}")
    dtype_list = parse_dtypes(dtypes or (QUICK_DTYPES if quick else DEFAULT_DTYPES))
    target = resolve_device(device)
    for shape in shape_list:
        check_fits(spec, shape, dtype_list, target)
    _positive("--trials", options.get("trials"))
    check_timeout(options.get("timeout_s"))
    check_seed(options.get("seed", 0))
    _positive("--calls", options.get("calls"))
    options["threads"] = resolve_threads(target, options.get("threads"))
    options["allocator"] = resolve_allocator(target, options.get("allocator"))
    if options.get("rank_by", "cold") not in RANK_MODES:
        raise UserError(f"--rank-by must be one of {', '.join(RANK_MODES)}")
    if options.get("timeout_s") is None:
        options["timeout_s"] = target.default_timeout_s
    named = variants_of(op)
    chosen = choose_variants(spec, named, variants, target.type)
    options["pass_name"] = check_pass(options.get("pass_name", FORWARD))
    check_backward(spec, options["pass_name"], [named[name] for name in chosen or ()])
    if quick:
        options.setdefault("timing", QUICK_TIMING)
        options.setdefault("profiler", QUICK_PROFILER)
    return SweepPlan(
        spec=spec,
        device=target,
        shapes=shape_list,
        dtypes=dtype_list,
        registered=named,
        variants=chosen,
        plugins=list(plugins),
        **options,
    )


def resolve_threads(device: Device, threads: int | None) -> int:
    """The CPU thread count a sweep measures with: as asked, else what torch uses now; 0 for
    other devices, whose kernels do not depend on host threads."""
    if device.type != "cpu":
        if threads is not None:
            raise UserError(f"--threads applies to cpu sweeps, not {device.type}")
        return 0
    if threads is None:
        return torch.get_num_threads()
    check_thread_count(threads)
    return threads


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which bound the threads it can run at
    once."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_thread_count(threads: int) -> None:
    """Refuse a `--threads` below 1 or above the CPUs this process may use: more threads than
    CPUs stall at every barrier (and torch crashes on absurd counts)."""
    if threads < 1:
        raise UserError(f"--threads must be at least 1 (got {threads})")
    cpus = usable_cpus()
    if threads > cpus:
        raise UserError(
            f"--threads {threads} is more than this machine can run at once: it has {cpus} "
            f"CPU(s) for this process; pass --threads {cpus} or fewer"
        )


def resolve_allocator(device: Device, name: str | None) -> str:
    """The host allocator setting a CPU sweep measures with (default `fixed`); "" elsewhere."""
    if device.type != "cpu":
        if name is not None:
            raise UserError(f"--allocator applies to cpu sweeps, not {device.type}")
        return ""
    return allocator.check(name or allocator.DEFAULT)


def valid_configs(variant: Variant, shape: Shape, device_type: str) -> list[Params]:
    """Every configuration of a finite variant that can run at this shape."""
    return [p for p in variant.configurations() if variant.rejects(shape, p, device_type) is None]


def first_config(variant: Variant, shape: Shape, device_type: str) -> Params:
    """The first configuration of the variant that can run at this shape."""
    for params in variant.configurations():
        if variant.rejects(shape, params, device_type) is None:
            return params
    raise UserError(
        f"variant {variant.name!r} has no configuration that runs at {format_shape(shape)}"
    )


def parse_params(variant: Variant, pairs: Sequence[str], shape: Shape, device_type: str) -> Params:
    """`NAME=VALUE` pairs over the variant's first valid configuration, checked before running."""
    params = first_config(variant, shape, device_type) if variant.tunables else {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in variant.tunables:
            raise UserError(
                f"--param {pair!r}: use NAME=VALUE with NAME among "
                f"{', '.join(variant.tunables) or '(no tunables)'}"
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            value = text
        problem = tunable_value_problem(variant.tunables[name], value)
        if problem:
            raise UserError(f"--param {pair!r}: {problem}")
        params[name] = value
    reason = variant.rejects(shape, params, device_type)
    if reason:
        raise UserError(f"params {params} cannot run: {reason}")
    return params


def tunable_value_problem(space: TunableSpace, value: object) -> str | None:
    """Why a value is not one of a tunable's own, or None when it is."""
    if isinstance(space, od.FloatDistribution):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not space.low <= value <= space.high:  # type: ignore[operator]
            return f"give a number from {space.low:g} to {space.high:g}"
        return None
    choices = (
        range(space.low, space.high + 1, space.step)
        if isinstance(space, od.IntDistribution)
        else list(space)
    )
    # `True == 1` and `1 == 1.0`: a value matches a choice only with the choice's own type.
    if any(type(value) is type(choice) and value == choice for choice in choices):
        return None
    shown = ", ".join(repr(c) for c in list(choices)[:12])
    more = ", ..." if len(choices) > 12 else ""
    return f"choose one of {shown}{more}"

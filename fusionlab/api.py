"""The Python API: plan and run sweeps, and look up the winners."""

from __future__ import annotations

from collections.abc import Sequence

from fusionlab.devices import resolve_device
from fusionlab.errors import UserError
from fusionlab.profiling import ProfilerSettings
from fusionlab.registry import get_op, load_entry_points, load_plugin, variants_of
from fusionlab.results import CellResult, load_cells
from fusionlab.search.runner import Progress, Sweep, SweepPlan
from fusionlab.search.storage import DEFAULT_STORAGE, open_storage
from fusionlab.shapes import parse_dtypes, parse_shapes
from fusionlab.timing import TimingSettings

DEFAULT_SHAPES = "1x4096,32x4096,512x4096,2048x8192"
DEFAULT_DTYPES = "float32,bfloat16"
QUICK_SHAPES = "1x4096,256x4096"
QUICK_DTYPES = "float32"
QUICK_TIMING = TimingSettings(warmup_s=0.02, budget_s=0.1, min_samples=7, max_samples=40)
QUICK_PROFILER = ProfilerSettings(wait=1, warmup=1, active=3)


def load_user_variants(plugins: Sequence[str]) -> None:
    """Entry points first, then plugin files; any failure is a UserError."""
    load_entry_points()
    for path in plugins:
        load_plugin(path)


def make_plan(
    op: str,
    shapes: str | None = None,
    dtypes: str | None = None,
    device: str = "auto",
    variants: str | Sequence[str] | None = None,
    plugins: Sequence[str] = (),
    quick: bool = False,
    **options: object,
) -> SweepPlan:
    """Validate every input and return the plan; nothing is measured or stored yet."""
    load_user_variants(plugins)
    spec = get_op(op)
    shape_list = parse_shapes(shapes or (QUICK_SHAPES if quick else DEFAULT_SHAPES))
    for shape in shape_list:
        problem = spec.check_shape(shape)
        if problem:
            raise UserError(f"shape {'x'.join(map(str, shape))}: {problem}")
    dtype_list = parse_dtypes(dtypes or (QUICK_DTYPES if quick else DEFAULT_DTYPES))
    target = resolve_device(device)
    chosen = _chosen_variants(op, variants, target.type)
    if quick:
        options.setdefault("timing", QUICK_TIMING)
        options.setdefault("profiler", QUICK_PROFILER)
    return SweepPlan(
        op=op,
        device=target,
        shapes=shape_list,
        dtypes=dtype_list,
        variants=chosen,
        plugins=list(plugins),
        **options,
    )  # type: ignore[arg-type]


def _chosen_variants(
    op: str, variants: str | Sequence[str] | None, device_type: str
) -> list[str] | None:
    if variants is None:
        return None
    names = (
        [n.strip() for n in variants.split(",")] if isinstance(variants, str) else list(variants)
    )
    known = variants_of(op)
    for name in names:
        if name not in known:
            raise UserError(f"unknown variant {name!r} of {op}: choose from {', '.join(known)}")
        reason = known[name].unavailable_reason(device_type)
        if reason:
            raise UserError(f"variant {name!r} cannot run on {device_type} here: {reason}")
    return list(dict.fromkeys(names))


def sweep(
    op: str,
    shapes: str | None = None,
    dtypes: str | None = None,
    *,
    device: str = "auto",
    storage: str = DEFAULT_STORAGE,
    progress: Progress | None = None,
    **options: object,
) -> list[CellResult]:
    """Run a sweep and return its cells (also stored in `storage`)."""
    plan = make_plan(op, shapes, dtypes, device, **options)  # type: ignore[arg-type]
    return Sweep(plan, open_storage(storage), progress).run()


def stored_cells(op: str, storage: str = DEFAULT_STORAGE) -> list[CellResult]:
    """Every stored cell of an op (all devices), without measuring."""
    get_op(op)
    return load_cells(open_storage(storage, must_exist=True), op)

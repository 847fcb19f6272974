"""The investigation behind `fusionlab compare` and `fusionlab profile`: variants profiled at one
shape and dtype.

Variants and parameters are chosen and validated by the same planning path as `sweep`, and run
through the same trial; the numbers are read off the profiler's events (see
measure/profiling.py), never parsed from printed tables."""

from __future__ import annotations

from typing import Any

from fusionlab import plan as planning
from fusionlab.errors import UserError
from fusionlab.measure.trial import TrialTask
from fusionlab.measure.worker import TrialWorker
from fusionlab.records import TrialRecord
from fusionlab.shapes import format_shape, parse_dtype, parse_shape


def plan_one_cell(op: str, shape: str, dtype: str, device: str, variants: str | None,
                  plugins: list[str], **options: Any) -> planning.SweepPlan:
    """The same planning path as sweep, for one shape and one dtype."""
    return planning.make_plan(
        op, format_shape(parse_shape(shape)), parse_dtype(dtype), device, variants, plugins,
        **options,
    )


def profile_configs(
    configs: list[tuple[str, dict[str, Any]]],
    plan: planning.SweepPlan,
    plugins: list[str],
    seed: int,
    table_rows: int,
    trace_dir: str | None,
) -> list[TrialRecord]:
    """One profiled trial per (variant, parameters), in a measuring worker."""
    cells = plan.cells()
    if not cells:
        raise UserError(f"no variant of {plan.op} runs {plan.dtypes[0]} on {plan.device.type}")
    (cell,) = cells  # one shape, one dtype
    records = []
    with TrialWorker(plugins, threads=plan.threads, allocator=plan.allocator) as worker:
        for name, params in configs:
            task = TrialTask(cell=cell, variant=name, params=params, seed=seed,
                             profile_table_rows=table_rows, trace_dir=trace_dir)
            records.append(TrialRecord.from_dict(worker.run(task, plan.timeout_s)))
    return records

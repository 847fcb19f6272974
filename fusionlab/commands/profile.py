"""`fusionlab profile`: profile one variant in depth."""

from __future__ import annotations

import argparse

from fusionlab import plan as planning
from fusionlab.commands.arguments import add_investigation_output, add_one_cell
from fusionlab.commands.compare import plan_of, trace_dir_of
from fusionlab.investigation import profile_configs
from fusionlab.records import TrialRecord
from fusionlab.registry import get_variant
from fusionlab.report import investigate

NAME = "profile"
HELP = "profile one variant in depth"


def add_arguments(command: argparse.ArgumentParser) -> None:
    add_one_cell(command)
    command.add_argument("--variant", required=True)
    command.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a tunable value (default: the first choice of each)",
    )
    add_investigation_output(command)


def run(args: argparse.Namespace) -> int:
    plan = plan_of(args, args.variant)
    trace_dir = trace_dir_of(args)
    (shape,) = plan.shapes
    variant = get_variant(args.op, args.variant)
    params = planning.parse_params(variant, args.param, shape, plan.device.type)
    records = profile_configs([(variant.name, params)], plan, args.plugin, args.seed, args.rows,
                              trace_dir)
    investigate.render(records, plan, trace_dir, args.wide)
    record = records[0]
    _print_depth(record)
    return 0 if record.passed else 1


def _print_depth(record: TrialRecord) -> None:
    """The ops per call, and where setup, first call and the samples' time went."""
    if record.fusion is not None:
        print("\nops per call:")
        for name, count in record.fusion.op_counts.items():
            print(f"  {count:g} x {name}")
    if record.timing is not None:
        timing = record.timing
        print(
            f"setup {record.setup_ms or 0:.4g} ms and first call "
            f"{record.first_call_ms or 0:.4g} ms "
            "(build and compile live there); "
            f"{len(timing.samples_ms)} samples of {timing.calls_per_sample} calls: median "
            f"{timing.median_ms:.4g} ms, IQR {timing.q1_ms:.4g}-{timing.q3_ms:.4g} ms, "
            f"CV {100 * timing.cv:.1f}%"
        )

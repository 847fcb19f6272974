"""`fusionlab compare`: profile every variant side by side at one shape."""

from __future__ import annotations

import argparse

from fusionlab import plan as planning
from fusionlab.commands.arguments import add_investigation_output, add_one_cell
from fusionlab.investigation import plan_one_cell, profile_configs
from fusionlab.report import investigate
from fusionlab.report.export import prepare_folder

NAME = "compare"
HELP = "profile every variant side by side at one shape"


def add_arguments(command: argparse.ArgumentParser) -> None:
    add_one_cell(command)
    command.add_argument("--variants", help="comma-separated (default: all available)")
    add_investigation_output(command)


def plan_of(args: argparse.Namespace, variants: str | None) -> planning.SweepPlan:
    """The one-cell plan of compare and profile, from their shared arguments."""
    return plan_one_cell(args.op, args.shape, args.dtype, args.device, variants, args.plugin,
                         timeout_s=args.timeout, seed=args.seed, threads=args.threads,
                         allocator=args.allocator)


def trace_dir_of(args: argparse.Namespace) -> str | None:
    return None if args.trace_dir is None else prepare_folder(args.trace_dir, "trace dir")


def run(args: argparse.Namespace) -> int:
    plan = plan_of(args, args.variants)
    trace_dir = trace_dir_of(args)
    (shape,), (dtype,) = plan.shapes, plan.dtypes
    configs = [
        (v.name, planning.first_config(v, shape, plan.device.type))
        for v in plan.cell_variants(dtype)
    ]
    records = profile_configs(configs, plan, args.plugin, args.seed, args.rows, trace_dir)
    investigate.render(records, plan, trace_dir, args.wide)
    return 0

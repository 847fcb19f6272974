"""`fusionlab sweep`: measure every variant across shapes and dtypes."""

from __future__ import annotations

import argparse
import os
import subprocess

import torch

from fusionlab import plan as planning
from fusionlab.commands.arguments import add_common, add_ranking, add_width, check_memory_budget
from fusionlab.commands.capture import capture_shapes
from fusionlab.commands.console import say, trial_line
from fusionlab.commands.sweep_table import print_table
from fusionlab.errors import UserError
from fusionlab.report import export
from fusionlab.report.progress import SweepProgress
from fusionlab.report.tables import best_rows, check_columns
from fusionlab.results import WinnersFile
from fusionlab.search.runner import Sweep
from fusionlab.search.storage import DEFAULT_STORAGE, describe, open_storage
from fusionlab.search.workers import check_worker_count, start_local_workers

NAME = "sweep"
HELP = "measure every variant across shapes and dtypes"


def add_arguments(sweep: argparse.ArgumentParser) -> None:
    add_common(sweep)
    sweep.add_argument("--shapes", help="comma-separated, e.g. 1x4096,4x2048x4096")
    sweep.add_argument(
        "--from-capture",
        metavar="FILE",
        help="sweep exactly the shapes, dtypes and threads a `fusionlab capture` file recorded",
    )
    sweep.add_argument("--dtypes", help="comma-separated, e.g. float32,bfloat16")
    sweep.add_argument("--variants", help="comma-separated subset of variants (default: all)")
    sweep.add_argument(
        "--pass",
        dest="pass_name",
        default="forward",
        metavar="PASS",
        help="what each call times, recorded in every cell: forward (default), backward (from a "
        "saved forward, a fresh upstream gradient each call) or forward+backward",
    )
    sweep.add_argument(
        "--trials",
        type=int,
        default=40,
        help="TPE budget per cell when its space is too large to enumerate",
    )
    sweep.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    sweep.add_argument("--fresh", action="store_true", help="measure again what is already stored")
    sweep.add_argument("--quick", action="store_true", help="a small sweep that ends in seconds")
    sweep.add_argument(
        "--no-screen",
        dest="screen",
        action="store_false",
        help="measure every configuration in full (default: a brief screen first, and in full "
        "only what is within 1.5x of the best measured in full in its cell)",
    )
    sweep.add_argument(
        "--export", metavar="FILE", help="also write the table (format by extension)"
    )
    sweep.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="local workers, one per device (needs a journal: or PostgreSQL storage)",
    )
    sweep.add_argument(
        "--pin", action="store_true", help="cpu: give each worker its own cores"
    )
    add_ranking(sweep)
    add_width(sweep)


def _threads(args: argparse.Namespace) -> int | None:
    """--threads as given; pinned workers default to the cores each one gets."""
    if not getattr(args, "pin", False) or args.workers < 2:
        return args.threads
    per_worker = len(os.sched_getaffinity(0)) // args.workers
    if args.threads is not None and args.threads > per_worker:
        raise UserError(
            f"--threads {args.threads} with --pin and {args.workers} workers: each worker gets "
            f"{per_worker} core(s); lower --threads or --workers"
        )
    return args.threads or max(per_worker, 1)


def _from_capture(args: argparse.Namespace) -> None:
    """--from-capture fills --shapes, --dtypes and (unless given) --threads from the capture."""
    if not getattr(args, "from_capture", None):
        return
    if args.shapes or args.dtypes:
        raise UserError("--from-capture sets the shapes and dtypes: drop --shapes/--dtypes")
    args.shapes, args.dtypes, threads = capture_shapes(args.op, args.from_capture)
    if args.threads is None and not args.pin:
        args.threads = threads


def _plan(args: argparse.Namespace) -> planning.SweepPlan:
    _from_capture(args)
    options = {
        "fresh": args.fresh,
        "trials": args.trials,
        "timeout_s": args.timeout,
        "seed": args.seed,
        "rank_by": args.rank_by,
        "calls": args.calls,
        "threads": _threads(args),
        "allocator": args.allocator,
        "screen": args.screen,
        "pass_name": args.pass_name,
    }
    return planning.make_plan(
        args.op,
        args.shapes,
        args.dtypes,
        args.device,
        args.variants,
        args.plugin,
        args.quick,
        **options,
    )


def run(args: argparse.Namespace) -> int:
    check_columns(args.columns)
    check_memory_budget(args.memory_budget, args.pass_name)
    plan = _plan(args)
    export_format = export.format_for(args.export) if args.export else None
    if args.export:
        export.check_writable(args.export)
    url = args.storage or DEFAULT_STORAGE
    warning = check_worker_count(plan.device, args.workers, args.pin, url)
    storage = open_storage(url)
    progress = SweepProgress(len(plan.cells()), trial_line)
    runner = Sweep(
        plan,
        storage,
        progress.trial,
        progress.say,
        starting=progress.starting,
        cell_done=progress.cell_done,
    )
    say(
        f"{args.op} on {plan.device.type}: {plan.device_label}, torch {torch.__version__}"
    )
    say(describe(url))
    if warning:
        say(f"warning: {warning}")
    if args.workers == 1:
        progress.begin(*runner.planned())
        try:
            cells = runner.run()
        finally:
            progress.close()
        _say_time_split(runner)
    else:
        runner.open()  # planned here, so every worker finds the whole sweep
        say(f"{args.workers} workers on {url}; `fusionlab status --storage {url}` shows them")
        runner.interrupted = _wait_for_workers(
            start_local_workers(url, plan, args.workers, args.pin)
        )
        cells = runner.results()
    print()
    print_table(cells, args.op, plan.rank_by, plan.calls, args.wide, args.columns,
                args.memory_budget)
    if args.export:
        rows = best_rows(cells, plan.rank_by, plan.calls, args.memory_budget)
        winners = WinnersFile(args.op, rows, ranked_by=plan.rank_by, storage=url)
        export.write(args.export, export.render(winners, export_format, args.columns))
        say(f"wrote {args.export}")
    if runner.interrupted:
        say("interrupted: everything measured so far is stored; run the same command to resume")
        return 130
    return 0


def _say_time_split(runner: Sweep) -> None:
    """What the search and the re-measurement cost, how the cells ended, and one warning when
    other processes disturbed the timings."""
    line = runner.closing_line()
    if line:
        say(line)
    for warning in (runner.busy_warning(), runner.stall_warning()):
        if warning:
            say(f"warning: {warning}")


def _wait_for_workers(workers: list[subprocess.Popen]) -> bool:
    """Wait for every local worker; True if the sweep was interrupted (Ctrl-C reaches them too,
    as one process group, and each gives its claim back)."""
    interrupted = False
    for worker in workers:
        while True:
            try:
                code = worker.wait()
                break
            except KeyboardInterrupt:
                interrupted = True
        if code == 130:
            interrupted = True
        elif code != 0:
            say(f"worker {worker.pid} exited with code {code}; its claims expire for the others")
    return interrupted

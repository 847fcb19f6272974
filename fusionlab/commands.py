"""What each `fusionlab` subcommand does; the parser lives in cli.py."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
from optuna.storages import BaseStorage
from tabulate import tabulate

from fusionlab import plan as planning
from fusionlab.devices import device_types, get_device, unavailable_reason
from fusionlab.errors import UserError
from fusionlab.records import TrialRecord
from fusionlab.registry import get_op, op_names, variants_of
from fusionlab.report import export, fit, investigate
from fusionlab.report.progress import SweepProgress
from fusionlab.report.tables import (
    BUSY_MARK,
    NOISY_IQR,
    ROUGH_DIGITS,
    best_rows,
    check_columns,
    terminal_table,
)
from fusionlab.results import CellResult, WinnersFile
from fusionlab.schema import user_facing
from fusionlab.search.claims import worker_name
from fusionlab.search.results_store import load_cells
from fusionlab.search.runner import Sweep
from fusionlab.search.storage import DEFAULT_STORAGE, describe, is_parallel_safe, open_storage
from fusionlab.search.workers import (
    check_worker_count,
    joinable_plans,
    pin_to_env_cores,
    start_local_workers,
    status_rows,
)
from fusionlab.shapes import format_shape
from fusionlab.toolchain import describe_difference

RANKING_NOTE = (
    "ranked by the {mode} median ({why}); contenders within 10% were re-measured in interleaved "
    "rounds (at least 5, more while undecided, 3 s a cell): runner-up/winner with a 95% bootstrap "
    "interval; faster: above 1.03, equivalent: inside [0.97, 1.03], inconclusive: neither (the "
    "better point estimate is named); equivalent ones go to the simpler lowering (builtin, "
    "baseline, compiled, custom), then the lower first-use cost. % copy = achieved GB/s over "
    "this device's copy bandwidth at the same size, measured in this run (fresh output with "
    "allocation / into an existing buffer)."
)
BUSY_NOTE = (
    f"{BUSY_MARK} after a figure: measured while other processes used more than a quarter of "
    "the cores, still so after re-measuring: slower and noisier than on a quiet machine (run "
    "again when the machine is quiet)"
)
NOISY_NOTE = (
    f"~ before a figure: its timing's IQR is above {100 * NOISY_IQR:.0f}% of its median, so it "
    f"keeps {ROUGH_DIGITS} significant digits (the IQR % column says how noisy)"
)
_WHY = {
    "cold": "inputs rotated past the last-level cache, as an op meets them inside a model",
    "warm": "two input sets that stay in cache: the best case, asked for with --rank-by warm",
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _busy(record: TrialRecord) -> str:
    """`  busy!` and the figure when the trial's timing stayed disturbed after re-measuring."""
    seen = record.disturbance
    if not seen.get("disturbed"):
        return ""
    return (f"  busy{BUSY_MARK} others used {100 * seen['other_share']:.0f}% of the cores "
            f"({seen.get('attempts', 1)} attempts)")


def _progress(record: TrialRecord, index: int, total: int, prefix: str = "") -> None:
    where = f"{prefix}[{index}/{total}] {format_shape(record.shape)} {record.dtype:<8}"
    if record.passed and record.timing is not None:
        cold = f", cold {record.cold.median_ms:.4g} ms" if record.cold is not None else ""
        detail = (
            f"warm {record.timing.median_ms:.4g} ms ±{100 * record.timing.relative_iqr:.1f}%"
            f"{cold}  first use {record.first_use_ms or 0:.4g} ms{_busy(record)}"
        )
    else:
        detail = f"{record.status.value.upper()}: {record.message}"
    say(f"{where} {record.config_label():<44} {detail}")


def print_table(
    cells: list[CellResult],
    op: str,
    mode: str,
    calls: int | None,
    wide: bool = False,
    chosen: str | None = None,
    memory_budget_mb: float | None = None,
) -> None:
    """The best-config table and its notes, fitted to the terminal's width."""
    width = fit.terminal_width()
    devices = sorted({cell.cell.device_label for cell in cells})
    rows = best_rows(cells, mode, calls, memory_budget_mb)
    text, left_out = terminal_table(rows, op, width, wide, chosen, with_device=len(devices) > 1)
    print(text)
    notes = [f"  {row.shape} {row.dtype}: {row.reason}" for row in rows if row.reason]
    for cell in cells:
        notes.extend(
            f"  failed: {cell.cell.label} {record.config_label()}: "
            f"{record.status.value}: {record.message[:160]}"
            for record in cell.failures()
        )
    if any(row.disturbed for row in rows):
        notes.append(BUSY_NOTE)
    if any(row.noisy for row in rows):
        notes.append(NOISY_NOTE)
    note = RANKING_NOTE.format(mode=mode, why=_WHY[mode])
    if calls is not None:
        note = f"ranked by first use + {calls} x {mode} latency (--calls); " + note
    if memory_budget_mb is not None:
        note = (f"backward rows: only configurations whose footprint, max(fwd peak, saved + bwd "
                f"peak), is at most {memory_budget_mb:g} MB compete (--memory-budget); " + note)
    notes.append(note)
    if left_out:
        notes.append(f"more columns: --wide, or --columns with any of {', '.join(left_out)}")
    for line in notes:
        print(fit.wrap(line.strip(), width, indent=line[: len(line) - len(line.lstrip())]))


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
    from fusionlab.model.commands import capture_shapes

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


def sweep(args: argparse.Namespace) -> int:
    check_columns(args.columns)
    _check_memory_budget(args.memory_budget, args.pass_name)
    plan = _plan(args)
    export_format = export.format_for(args.export) if args.export else None
    if args.export:
        export.check_writable(args.export)
    url = args.storage or DEFAULT_STORAGE
    warning = check_worker_count(plan.device, args.workers, args.pin, url)
    storage = open_storage(url)
    progress = SweepProgress(len(plan.cells()), _progress)
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


def worker_command(args: argparse.Namespace) -> int:
    pin_to_env_cores()
    unsafe = is_parallel_safe(args.storage)  # said before anything else about the storage
    if unsafe:
        raise UserError(unsafe)
    storage = open_storage(args.storage, must_exist=True)
    me = f"worker {worker_name()}"
    joined = joinable_plans(
        storage, args.storage, args.op, lambda text: say(f"{me}: {text}"), args.plan
    )

    def progress(record: TrialRecord, index: int, total: int) -> None:
        _progress(record, index, total, prefix=f"{me} ")

    measured = 0
    for plan in joined:
        runner = Sweep(plan, storage, progress, lambda text: say(f"{me}: {text}"), spread=True)
        runner.run()
        measured += len(runner.measured_here)
        if runner.interrupted:
            say(f"{me}: interrupted after {measured} measurements; its claim went back")
            return 130
    say(f"{me}: done, measured {measured} configurations")
    return 0


def _check_calls(calls: int | None) -> None:
    if calls is not None and calls < 1:
        raise UserError(f"--calls must be at least 1 (got {calls})")


def _check_memory_budget(budget_mb: float | None, pass_name: str | None) -> None:
    """A budget is a positive number of MB, for a pass that has a backward (None: any pass)."""
    if budget_mb is None:
        return
    if not budget_mb > 0:
        raise UserError(f"--memory-budget must be a positive number of MB (got {budget_mb:g})")
    if pass_name == "forward":
        raise UserError("--memory-budget ranks backward passes (their memory is measured); "
                        "add --pass backward or --pass forward+backward")


def _stored_cells(storage: BaseStorage, url: str, op: str) -> list[CellResult]:
    """The stored cells of an op; data this fusionlab cannot read is said in one line."""
    with user_facing(f"results in {url}"):
        return load_cells(storage, op)


def status_command(args: argparse.Namespace) -> int:
    storage = open_storage(args.storage, must_exist=True, read_only=True)
    with user_facing(f"results in {args.storage}"):
        rows = status_rows(storage, args.op)
    if args.op is not None and not rows:
        planning.load_user_variants(())
        get_op(args.op)  # an op no stored sweep names, and none registered here: a typo
    if not rows:
        say(f"no sweep is planned in {args.storage}")
        return 0
    print(tabulate(rows, headers="keys", tablefmt="simple", disable_numparse=True))
    return 0


def _stale_notes(cells: list[CellResult], op: str) -> list[str]:
    """One line per stored toolchain that differs from the installed one."""
    notes = []
    installed = {}
    for cell in cells:
        device = cell.cell.device
        if device not in installed and unavailable_reason(device) is None:
            installed[device] = planning.installed_toolchain(op, device)
        current = installed.get(device)
        if current is not None and current != cell.cell.toolchain:
            notes.append(
                f"{cell.cell.label} on {cell.cell.device_name} was measured with another "
                f"toolchain ({describe_difference(cell.cell.toolchain, current)}); run "
                f"`fusionlab sweep {op}` to measure it with the installed one"
            )
    return sorted(set(notes))


def export_command(args: argparse.Namespace) -> int:
    url = args.storage or DEFAULT_STORAGE
    fmt = export.format_for(args.output, args.format)
    _check_calls(args.calls)
    _check_memory_budget(args.memory_budget, None)
    planning.load_user_variants(args.plugin)
    get_op(args.op)
    check_columns(args.columns)
    storage = open_storage(url, must_exist=True, read_only=True)
    if args.output:
        export.check_writable(args.output)
    cells = _stored_cells(storage, url, args.op)
    for note in _stale_notes(cells, args.op):
        say(f"note: {note}")
    rows = best_rows(cells, args.rank_by, args.calls, args.memory_budget)
    if not args.output and args.format is None:  # for reading: Markdown that fits the terminal
        devices = sorted({cell.cell.device_name for cell in cells})
        text, left_out = terminal_table(
            rows, args.op, fit.terminal_width(), args.wide, args.columns, len(devices) > 1, "github"
        )
        if len(devices) == 1:
            say(f"measured on {devices[0]}")
        sys.stdout.write(text + "\n")
        if left_out:
            say("more columns: --wide, --columns A,B,C, or --format md for every column")
        return 0
    winners = WinnersFile(args.op, rows, ranked_by=args.rank_by, storage=url)
    text = export.render(winners, fmt, args.columns)
    if args.output:
        export.write(args.output, text)
        say(f"wrote {args.output} ({len(cells)} rows)")
    else:
        sys.stdout.write(text)
    return 0


def _tunables(values: dict) -> str:
    return (
        "; ".join(
            f"{k}={list(v) if isinstance(v, (list, tuple)) else v}" for k, v in values.items()
        )
        or "-"
    )


def _backward_tunables(values: dict) -> str:
    """Tunables of the backward alone, marked: only passes with a backward sweep them."""
    return f"; {_tunables(values)} (backward passes)" if values else ""


def list_command(args: argparse.Namespace) -> int:
    planning.load_user_variants(args.plugin)
    ops = [get_op(args.op).name] if args.op else op_names()
    if args.device is not None and args.device not in device_types():
        raise UserError(
            f"unknown device {args.device!r}: choose from {', '.join(device_types())}"
        )
    here = {d: unavailable_reason(d) for d in device_types()}
    rows, reasons = [], {}
    for op in ops:
        for variant in variants_of(op).values():
            devices = [d for d in variant.devices if args.device in (None, d)]
            if not devices:
                continue
            runs = []
            for device in devices:
                reason = here[device] or variant.unavailable_reason(device)
                if reason is None:
                    runs.append(device)
                else:
                    reasons.setdefault(reason, []).append(f"{variant.name} on {device}")
            rows.append(
                {
                    "op": op,
                    "variant": variant.name,
                    "kind": variant.kind,
                    "runs here": ", ".join(runs) or "no",
                    "devices": ", ".join(devices),
                    "tunables": _tunables(variant.tunables)
                    + _backward_tunables(variant.backward_tunables),
                    "what": variant.description,
                }
            )
    width = fit.terminal_width()
    order = ["op", "variant", "kind", "runs here", "devices", "tunables", "what"]
    if args.wide:
        width = 10**6
    text, left_out = fit.fit_table(rows, order, width, shrinkable=["tunables", "what"])
    print(text)
    for reason, where in reasons.items():
        ops_named = sorted({name.split(" on ")[1] for name in where})
        note = f"not here on {', '.join(ops_named)}: {reason} ({len(where)} variants)"
        print(fit.wrap(note, width))
    for name in device_types():
        note = get_device(name).cold_sweep_note
        if note and args.device in (None, name):
            print(fit.wrap(f"cold sweep on {name}: {note}", width))
    if left_out:
        print(fit.wrap(f"left out to fit: {', '.join(left_out)} (--wide shows them)", width))
    return 0


def report_command(args: argparse.Namespace) -> int:
    url = args.storage or DEFAULT_STORAGE
    export.check_writable(args.output)
    if args.plots:
        investigate.prepare_folder(args.plots, "plots dir")
    planning.load_user_variants(args.plugin)
    get_op(args.op)
    cells = _stored_cells(open_storage(url, must_exist=True), url, args.op)
    if not cells:
        raise UserError(f"no results of {args.op} in {url}: run `fusionlab sweep {args.op}` first")
    for note in _stale_notes(cells, args.op):
        say(f"note: {note}")
    from fusionlab.report import html  # matplotlib loads only for this command

    page, saved = html.render(args.op, cells, args.rank_by, url, args.plots)
    export.write(args.output, page)
    say(f"wrote {args.output} ({len(cells)} cells)")
    for path in saved:
        say(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed command line."""
    from fusionlab.model import commands as model_commands

    handlers = {
        "sweep": sweep,
        "export": export_command,
        "list": list_command,
        "compare": investigate.compare_command,
        "profile": investigate.profile_command,
        "worker": worker_command,
        "status": status_command,
        "capture": model_commands.capture_command,
        "bench-model": model_commands.bench_model_command,
        "report": report_command,
    }
    with user_facing("stored results"):  # whatever command reads data it cannot understand
        return handlers[args.command](args)

"""What each `fusionlab` subcommand does; the parser lives in cli.py."""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from fusionlab import api, export, investigate
from fusionlab.devices import DEVICE_TYPES, unavailable_reason
from fusionlab.records import TrialRecord
from fusionlab.registry import op_names, variants_of
from fusionlab.results import CellResult
from fusionlab.search.runner import Sweep
from fusionlab.search.storage import DEFAULT_STORAGE, describe, open_storage
from fusionlab.shapes import format_shape
from fusionlab.tables import best_rows, display_rows


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(record: TrialRecord, index: int, total: int) -> None:
    where = f"[{index}/{total}] {format_shape(tuple(record.shape))} {record.dtype:<8}"
    if record.passed and record.timing is not None:
        timing = record.timing
        detail = (
            f"{timing.median_ms:.4g} ms ±{100 * timing.relative_iqr:.1f}%  "
            f"setup {record.setup_ms or 0:.4g} ms, first call {timing.first_call_ms:.4g} ms"
        )
    else:
        detail = f"{record.status.value.upper()}: {record.message}"
    _say(f"{where} {record.config_label():<48} {detail}")


def _print_table(cells: list[CellResult]) -> None:
    devices = sorted({cell.device_name for cell in cells})
    shown = display_rows(best_rows(cells), with_device=len(devices) > 1)
    print(tabulate(shown, headers="keys", tablefmt="simple", disable_numparse=True))
    failures = [r for cell in cells for r in cell.failures()]
    for record in failures:
        print(
            f"  failed: {format_shape(tuple(record.shape))} {record.dtype} "
            f"{record.config_label()}: {record.status.value}: {record.message[:160]}"
        )
    print(
        "median ms over synchronised samples; IQR % = interquartile range / median; "
        "tie = the fastest two IQRs overlap; ops/call and idle % from torch.profiler"
    )


def sweep(args: argparse.Namespace) -> int:
    options = {
        "fresh": args.fresh,
        "trials": args.trials,
        "timeout_s": args.timeout,
        "seed": args.seed,
    }
    plan = api.make_plan(
        args.op,
        args.shapes,
        args.dtypes,
        args.device,
        args.variants,
        args.plugin,
        args.quick,
        **options,
    )
    export_format = export.format_for(args.export) if args.export else None
    if args.export:
        export.check_writable(args.export)
    url = args.storage or DEFAULT_STORAGE
    storage = open_storage(url)
    runner = Sweep(plan, storage, _progress)
    _say(f"{args.op} on {plan.device.type}: {runner.device_name}, torch {torch.__version__}")
    _say(describe(url))
    cells = runner.run()
    print()
    _print_table(cells)
    if args.export:
        meta = {"op": args.op, "storage": url, "torch": torch.__version__}
        export.write(
            args.export, export.render(best_rows(cells), export_format, meta)
        )
        _say(f"wrote {args.export}")
    if runner.interrupted:
        _say("interrupted: everything measured so far is stored; run the same command to resume")
        return 130
    return 0


def export_command(args: argparse.Namespace) -> int:
    url = args.storage or DEFAULT_STORAGE
    fmt = export.format_for(args.output, args.format)
    if args.output:
        export.check_writable(args.output)
    cells = api.stored_cells(args.op, url)
    text = export.render(best_rows(cells), fmt, {"op": args.op, "storage": url})
    if args.output:
        export.write(args.output, text)
        _say(f"wrote {args.output} ({len(cells)} rows)")
    else:
        sys.stdout.write(text)
    return 0


def list_command(args: argparse.Namespace) -> int:
    api.load_user_variants(args.plugin)
    here = {d: unavailable_reason(d) for d in DEVICE_TYPES}
    rows = []
    for op in op_names():
        for variant in variants_of(op).values():
            status = []
            for device in variant.devices:
                reason = here[device] or variant.unavailable_reason(device)
                status.append(f"{device}: {'yes' if reason is None else 'no - ' + reason}")
            tunables = (
                "; ".join(
                    f"{k}={list(v) if isinstance(v, (list, tuple)) else v}"
                    for k, v in variant.tunables.items()
                )
                or "-"
            )
            rows.append([op, variant.name, variant.description, tunables, "\n".join(status)])
    print(
        tabulate(
            rows,
            headers=["op", "variant", "what", "tunables", "runs here"],
            tablefmt="grid",
            maxcolwidths=[None, None, 40, 40, 60],
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed command line."""
    handlers = {
        "sweep": sweep,
        "export": export_command,
        "list": list_command,
        "compare": investigate.compare_command,
        "profile": investigate.profile_command,
    }
    return handlers[args.command](args)

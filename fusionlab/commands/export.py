"""`fusionlab export`: render stored results without measuring."""

from __future__ import annotations

import argparse
import sys

from fusionlab import plan as planning
from fusionlab.commands.arguments import (
    add_plugin,
    add_ranking,
    add_width,
    check_calls,
    check_memory_budget,
)
from fusionlab.commands.console import say
from fusionlab.commands.stored import stale_notes, stored_cells
from fusionlab.registry import get_op
from fusionlab.report import export, fit
from fusionlab.report.tables import best_rows, check_columns, terminal_table
from fusionlab.results import WinnerRow, WinnersFile
from fusionlab.search.storage import DEFAULT_STORAGE, open_storage

NAME = "export"
HELP = "render stored results without measuring"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op")
    parser.add_argument(
        "--format", help="md, csv, json, latex or html (default: by extension, else md)"
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    parser.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    add_plugin(parser)
    add_ranking(parser)
    add_width(parser)


def run(args: argparse.Namespace) -> int:
    url = args.storage or DEFAULT_STORAGE
    fmt = export.format_for(args.output, args.format)
    check_calls(args.calls)
    check_memory_budget(args.memory_budget, None)
    planning.load_user_variants(args.plugin)
    get_op(args.op)
    check_columns(args.columns)
    storage = open_storage(url, must_exist=True, read_only=True)
    if args.output:
        export.check_writable(args.output)
    cells = stored_cells(storage, url, args.op)
    for note in stale_notes(cells, args.op):
        say(f"note: {note}")
    rows = best_rows(cells, args.rank_by, args.calls, args.memory_budget)
    if not args.output and args.format is None:  # for reading: Markdown that fits the terminal
        _print_for_reading(args, rows, sorted({cell.cell.device_name for cell in cells}))
        return 0
    winners = WinnersFile(args.op, rows, ranked_by=args.rank_by, storage=url)
    text = export.render(winners, fmt, args.columns)
    if args.output:
        export.write(args.output, text)
        say(f"wrote {args.output} ({len(cells)} rows)")
    else:
        sys.stdout.write(text)
    return 0


def _print_for_reading(args: argparse.Namespace, rows: list[WinnerRow], devices: list[str]) -> None:
    """The rows as Markdown fitted to the terminal, the device named once on stderr."""
    text, left_out = terminal_table(
        rows, args.op, fit.terminal_width(), args.wide, args.columns, len(devices) > 1, "github"
    )
    if len(devices) == 1:
        say(f"measured on {devices[0]}")
    sys.stdout.write(text + "\n")
    if left_out:
        say("more columns: --wide, --columns A,B,C, or --format md for every column")

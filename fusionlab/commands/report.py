"""`fusionlab report`: an HTML page of stored results with plots."""

from __future__ import annotations

import argparse

from fusionlab import plan as planning
from fusionlab.commands.arguments import add_plugin
from fusionlab.commands.console import say
from fusionlab.commands.stored import stale_notes, stored_cells
from fusionlab.errors import UserError
from fusionlab.registry import get_op
from fusionlab.report import export
from fusionlab.search.storage import DEFAULT_STORAGE, open_storage

NAME = "report"
HELP = "an HTML page of stored results with plots (opens offline)"


def add_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("op")
    report.add_argument(
        "-o", "--output", default="report.html", metavar="FILE", help="default report.html"
    )
    report.add_argument("--plots", metavar="DIR", help="also write each plot as SVG and PNG here")
    report.add_argument("--storage", help="Optuna storage URL (default sqlite:///fusionlab.db)")
    add_plugin(report)
    report.add_argument(
        "--rank-by",
        choices=("cold", "warm"),
        default="cold",
        help="rank by the cache-cold median (default) or the warm one",
    )


def run(args: argparse.Namespace) -> int:
    url = args.storage or DEFAULT_STORAGE
    export.check_writable(args.output)
    if args.plots:
        export.prepare_folder(args.plots, "plots dir")
    planning.load_user_variants(args.plugin)
    get_op(args.op)
    cells = stored_cells(open_storage(url, must_exist=True), url, args.op)
    if not cells:
        raise UserError(f"no results of {args.op} in {url}: run `fusionlab sweep {args.op}` first")
    for note in stale_notes(cells, args.op):
        say(f"note: {note}")
    from fusionlab.report import html  # matplotlib loads only for this command

    page, saved = html.render(args.op, cells, args.rank_by, url, args.plots)
    export.write(args.output, page)
    say(f"wrote {args.output} ({len(cells)} cells)")
    for path in saved:
        say(f"wrote {path}")
    return 0

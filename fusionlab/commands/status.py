"""`fusionlab status`: what a sweep has done, is running and has left."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from fusionlab import plan as planning
from fusionlab.commands.console import say
from fusionlab.registry import get_op
from fusionlab.schema import user_facing
from fusionlab.search.storage import open_storage
from fusionlab.search.workers import status_rows

NAME = "status"
HELP = "what a sweep has done, is running and has left"


def add_arguments(status: argparse.ArgumentParser) -> None:
    status.add_argument("--storage", required=True, help="the sweep's storage URL")
    status.add_argument("--op", help="only this op's cells")


def run(args: argparse.Namespace) -> int:
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

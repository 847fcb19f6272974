"""`fusionlab worker`: join a sweep planned in a shared storage."""

from __future__ import annotations

import argparse

from fusionlab.commands.console import say, trial_line
from fusionlab.errors import UserError
from fusionlab.records import TrialRecord
from fusionlab.search.claims import worker_name
from fusionlab.search.runner import Sweep
from fusionlab.search.storage import is_parallel_safe, open_storage
from fusionlab.search.workers import joinable_plans, pin_to_env_cores

NAME = "worker"
HELP = "join a sweep planned in a shared storage"


def add_arguments(worker: argparse.ArgumentParser) -> None:
    worker.add_argument("--storage", required=True, help="the sweep's storage URL")
    worker.add_argument("--op", help="join only this op's sweeps")
    worker.add_argument(
        "--plan", metavar="ID", help="join only this sweep plan (a sweep's own workers get it)"
    )


def run(args: argparse.Namespace) -> int:
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
        trial_line(record, index, total, prefix=f"{me} ")

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

"""One module per `fusionlab` subcommand: each names itself (NAME, HELP), adds its arguments
(`add_arguments`) and runs (`run`, returning the exit code). cli.py assembles them in this order,
the order `fusionlab --help` lists them."""

from fusionlab.commands import (
    bench_model,
    capture,
    compare,
    export,
    listing,
    profile,
    report,
    status,
    sweep,
    worker,
)

COMMANDS = (sweep, worker, status, export, report, capture, bench_model, listing, compare, profile)

"""The `fusionlab` command line. User errors become one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from fusionlab.commands import COMMANDS
from fusionlab.errors import UserError
from fusionlab.schema import user_facing


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"fusionlab: {message} (see fusionlab {self.prog.split()[-1]} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, in the order of COMMANDS."""
    parser = _Parser(prog="fusionlab", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_arguments(subparsers.add_parser(command.NAME, help=command.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fusionlab` command."""
    args = build_parser().parse_args(argv)
    command = {command.NAME: command for command in COMMANDS}[args.command]
    try:
        with user_facing("stored results"):  # whatever command reads data it cannot understand
            return command.run(args)
    except UserError as error:
        print(f"fusionlab: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

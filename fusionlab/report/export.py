"""Rendering the best-config table as md, csv, json, latex or html, and checking where output
files go before anything is measured."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from tabulate import tabulate

from fusionlab.errors import UserError
from fusionlab.report.tables import chosen_rows, display_rows
from fusionlab.results import WinnersFile

FORMATS = ("md", "csv", "json", "latex", "html")
_SUFFIXES = {
    ".md": "md",
    ".markdown": "md",
    ".csv": "csv",
    ".json": "json",
    ".tex": "latex",
    ".latex": "latex",
    ".html": "html",
    ".htm": "html",
}


def format_for(path: str | None, requested: str | None = None) -> str:
    """The format to write: the one asked for, else the file's extension, else md."""
    if requested is not None:
        if requested not in FORMATS:
            raise UserError(
                f"unknown export format {requested!r}: choose from {', '.join(FORMATS)}"
            )
        return requested
    if path is None:
        return "md"
    fmt = _SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise UserError(
            f"cannot tell the export format of {path!r}: use an extension among "
            f"{', '.join(sorted(_SUFFIXES))} or pass --format"
        )
    return fmt


def check_writable(path: str) -> None:
    """Fail early, before any measurement, when the export file cannot be written."""
    file = Path(path)
    folder = file.parent
    if not folder.is_dir():
        raise UserError(f"cannot write {path!r}: folder {str(folder)!r} does not exist")
    if file.is_dir():
        raise UserError(f"cannot write {path!r}: it is a folder")
    existed = file.exists()
    try:  # proven by opening it for writing (appending nothing), not guessed from permissions
        with file.open("a", encoding="utf-8"):
            pass
    except OSError as error:
        raise UserError(f"cannot write {path!r}: {error.strerror or error}") from None
    if not existed:
        file.unlink()


def prepare_folder(path: str, what: str) -> str:
    """Create a folder for output files; one line to the user when it cannot be written."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {what} {path!r} ({error.strerror}); pick another") from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"{what} {path!r} is not writable; pick another")
    return str(folder.resolve())


def render(winners: WinnersFile, fmt: str, chosen: str | None = None) -> str:
    """The table in one format: json is the winners file (typed rows and their metadata, which
    the Dispatcher reads), the others show the same rows as text. `chosen` (`--columns a,b,c`)
    keeps exactly those columns in every format; json then holds each row's text by column key
    (a table, no longer a winners file)."""
    if chosen is not None:
        keys, shown = chosen_rows(winners.rows, winners.op, chosen)
        if fmt == "json":
            meta = {"op": winners.op, "ranked_by": winners.ranked_by, "columns": keys}
            rows = [dict(zip(keys, text.values(), strict=True)) for text in shown]
            return json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    elif fmt == "json":
        return json.dumps(winners.to_dict(), indent=2) + "\n"
    else:
        shown = display_rows(winners.rows, winners.op)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(shown[0]) if shown else [])
        writer.writeheader()
        writer.writerows(shown)
        return buffer.getvalue()
    table_format = {"md": "github", "latex": "latex_booktabs", "html": "html"}[fmt]
    return tabulate(shown, headers="keys", tablefmt=table_format, disable_numparse=True) + "\n"


def write(path: str, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")

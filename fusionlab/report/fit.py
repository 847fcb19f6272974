"""Text tables and notes that fit the terminal: the most important columns first, the rest on
request (`--wide`, `--columns`)."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

from tabulate import tabulate

from fusionlab.errors import UserError

_MIN_CELL = 16  # a shortened cell keeps at least this many characters (with its "…")


def terminal_width() -> int:
    """$COLUMNS, else the terminal's width, else 80 (shutil.get_terminal_size's rules)."""
    return shutil.get_terminal_size((80, 24)).columns


def widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def _shorten(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: max(limit - 1, 1)] + "…"


def _render(
    rows: list[dict[str, str]], keys: Sequence[str], limits: dict[str, int], fmt: str
) -> str:
    shown = [
        {key: _shorten(row.get(key, ""), limits.get(key, 10**6)) for key in keys} for row in rows
    ]
    if not shown:
        return tabulate([], headers=list(keys), tablefmt=fmt, disable_numparse=True)
    return tabulate(shown, headers="keys", tablefmt=fmt, disable_numparse=True)


def fit_table(
    rows: list[dict[str, str]],
    priority: Sequence[str],
    width: int,
    shrinkable: Sequence[str] = (),
    fmt: str = "simple",
) -> tuple[str, list[str]]:
    """The table with as many of `priority`'s columns (most important first) as fit in `width`;
    cells of `shrinkable` columns are shortened before a column is dropped. Returns the text and
    the columns left out. The first two columns always stay; a line that still does not fit is
    cut, so no line is ever wider than `width`."""
    keys = list(priority)
    while True:
        limits: dict[str, int] = {}
        text = _render(rows, keys, limits, fmt)
        for key in (k for k in shrinkable if k in keys):
            if widest(text) <= width:
                break
            longest = max((len(row.get(key, "")) for row in rows), default=0)
            limits[key] = max(_MIN_CELL, longest - (widest(text) - width))
            text = _render(rows, keys, limits, fmt)
        if widest(text) <= width or len(keys) <= 2:
            break
        keys.pop()
    left_out = [key for key in priority if key not in keys]
    lines = [_shorten(line, width) for line in text.splitlines()]
    return "\n".join(lines), left_out


def pick_columns(requested: str, known: Sequence[str]) -> list[str]:
    """The columns named in `--columns a,b,c`, in that order; an unknown name is a UserError."""
    names = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(
            f"unknown column {', '.join(unknown) or '(none given)'!s}: choose from "
            f"{', '.join(known)}"
        )
    return names


def wrap(text: str, width: int, indent: str = "") -> str:
    """A note wrapped to the width, continuation lines indented."""
    return textwrap.fill(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=True,
        break_on_hyphens=False,
    )


def crop_fixed_table(text: str, width: int) -> tuple[str, bool]:
    """A fixed-width table (torch.profiler's key_averages) cut after the last whole column that
    fits; columns are found from its dashed rule line. Returns the text and whether it was cut."""
    lines = text.splitlines()
    if widest(text) <= width:
        return text, False
    rule = next((line for line in lines if line.strip() and set(line.strip()) <= {"-", " "}), "")
    ends = [i for i in range(1, len(rule) + 1) if rule[i - 1] == "-" and rule[i : i + 1] != "-"]
    fitting = [end for end in ends if end <= width]
    cut = fitting[-1] if fitting else width
    return "\n".join(line[:cut].rstrip() for line in lines), True

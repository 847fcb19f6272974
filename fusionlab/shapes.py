"""Parsing and formatting of the shapes and dtypes a user types."""

from __future__ import annotations

import torch

from fusionlab.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse `4x2048x4096` into a tuple of positive ints."""
    parts = text.strip().split("x")
    # isdigit() alone accepts '²' and other digits int() refuses: only ASCII digits are dims.
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise UserError(
            f"shape {text!r} does not parse: "
            "write dims as positive integers joined by a lower-case 'x', e.g. 32x4096"
        )
    dims = tuple(int(p) for p in parts)
    if any(d == 0 for d in dims):
        raise UserError(f"shape {text!r} has a zero dimension: every dim must be at least 1")
    return dims


def parse_list(text: str, option: str) -> list[str]:
    """A comma-separated list; an empty item is a typo worth saying so."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip():
        raise UserError(f"{option} is empty: give a comma-separated list")
    if any(not item for item in items):
        raise UserError(f"{option} {text!r} has an empty item: remove the extra comma")
    return items


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """Parse a comma-separated list of shapes, dropping duplicates."""
    return list(dict.fromkeys(parse_shape(item) for item in parse_list(text, "--shapes")))


def format_shape(shape: tuple[int, ...]) -> str:
    """The canonical text form of a shape, e.g. `32x4096`."""
    return "x".join(str(d) for d in shape)


def parse_dtype(text: str) -> str:
    """Normalise a dtype name (accepts fp32/bf16/fp16 aliases)."""
    name = _DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if name not in DTYPES:
        raise UserError(f"unknown dtype {text!r}: choose from {', '.join(DTYPES)}")
    return name


def parse_dtypes(text: str) -> list[str]:
    """Parse a comma-separated list of dtype names."""
    return list(dict.fromkeys(parse_dtype(item) for item in parse_list(text, "--dtypes")))


def dtype_name(dtype: object) -> str:
    """The canonical name of a torch dtype fusionlab measures; TypeError for any other."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise TypeError(
        f"fusionlab measures and dispatches {', '.join(DTYPES)} tensors, not {dtype}: convert "
        "the input (e.g. x.float()) or call the op directly"
    )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a canonical dtype name."""
    return DTYPES[name]

"""`fusionlab list`: ops and variants, and whether each runs here."""

from __future__ import annotations

import argparse

from fusionlab import plan as planning
from fusionlab.commands.arguments import add_plugin
from fusionlab.devices import device_types, get_device, unavailable_reason
from fusionlab.errors import UserError
from fusionlab.registry import Variant, get_op, op_names, variants_of
from fusionlab.report import fit

NAME = "list"
HELP = "ops and variants, and whether each runs here"
_ORDER = ["op", "variant", "kind", "runs here", "devices", "tunables", "what"]


def add_arguments(listing: argparse.ArgumentParser) -> None:
    add_plugin(listing)
    listing.add_argument("--op", help="only this op's variants")
    listing.add_argument("--device", help="only variants for this device type (cpu, cuda, ...)")
    listing.add_argument("--wide", action="store_true", help="every column, descriptions too")


def run(args: argparse.Namespace) -> int:
    planning.load_user_variants(args.plugin)
    ops = [get_op(args.op).name] if args.op else op_names()
    if args.device is not None and args.device not in device_types():
        raise UserError(
            f"unknown device {args.device!r}: choose from {', '.join(device_types())}"
        )
    here = {d: unavailable_reason(d) for d in device_types()}
    rows: list[dict[str, str]] = []
    reasons: dict[str, list[str]] = {}
    for op in ops:
        for variant in variants_of(op).values():
            row = _row(op, variant, args.device, here, reasons)
            if row is not None:
                rows.append(row)
    width = 10**6 if args.wide else fit.terminal_width()
    text, left_out = fit.fit_table(rows, _ORDER, width, shrinkable=["tunables", "what"])
    print(text)
    for line in _notes(reasons, args.device, left_out):
        print(fit.wrap(line, width))
    return 0


def _row(op: str, variant: Variant, device: str | None, here: dict[str, str | None],
         reasons: dict[str, list[str]]) -> dict[str, str] | None:
    """The variant's row (None when it has no device asked for); why it cannot run on a device
    goes into `reasons`."""
    devices = [d for d in variant.devices if device in (None, d)]
    if not devices:
        return None
    runs = []
    for name in devices:
        reason = here[name] or variant.unavailable_reason(name)
        if reason is None:
            runs.append(name)
        else:
            reasons.setdefault(reason, []).append(f"{variant.name} on {name}")
    return {
        "op": op,
        "variant": variant.name,
        "kind": variant.kind,
        "runs here": ", ".join(runs) or "no",
        "devices": ", ".join(devices),
        "tunables": _tunables(variant.tunables) + _backward_tunables(variant.backward_tunables),
        "what": variant.description,
    }


def _notes(reasons: dict[str, list[str]], device: str | None, left_out: list[str]) -> list[str]:
    """Why variants cannot run here, the devices' cold-sweep notes, and the columns left out."""
    notes = []
    for reason, where in reasons.items():
        ops_named = sorted({name.split(" on ")[1] for name in where})
        notes.append(f"not here on {', '.join(ops_named)}: {reason} ({len(where)} variants)")
    for name in device_types():
        note = get_device(name).cold_sweep_note
        if note and device in (None, name):
            notes.append(f"cold sweep on {name}: {note}")
    if left_out:
        notes.append(f"left out to fit: {', '.join(left_out)} (--wide shows them)")
    return notes


def _tunables(values: dict) -> str:
    return (
        "; ".join(
            f"{k}={list(v) if isinstance(v, (list, tuple)) else v}" for k, v in values.items()
        )
        or "-"
    )


def _backward_tunables(values: dict) -> str:
    """Tunables of the backward alone, marked: only passes with a backward sweep them."""
    return f"; {_tunables(values)} (backward passes)" if values else ""

"""`fusionlab capture`: record a model's norm calls, numerics and times; and the shapes
`sweep --from-capture` measures."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from fusionlab.commands.arguments import add_model_source, add_plugin
from fusionlab.commands.console import say
from fusionlab.commands.model_recipe import model_from_recipe, recipe_of, set_threads
from fusionlab.errors import UserError
from fusionlab.model.candidates import FusionCandidate
from fusionlab.model.capture import Capture, capture
from fusionlab.plan import load_user_variants
from fusionlab.plausible import marked, share_problem
from fusionlab.registry import get_op
from fusionlab.report.export import check_writable
from fusionlab.shapes import format_shape

NAME = "capture"
HELP = "record a model's norm calls, numerics and times"


def add_arguments(cap: argparse.ArgumentParser) -> None:
    add_model_source(cap, again=False)
    cap.add_argument("--threads", type=int, help="cpu threads (default: what torch uses)")
    cap.add_argument("-o", "--output", default="capture.json", help="the capture file to write")
    add_plugin(cap)


def run(args: argparse.Namespace) -> int:
    load_user_variants(args.plugin)
    set_threads(args.threads)
    check_writable(args.output)
    recipe = recipe_of(args, {})
    model, steps = model_from_recipe(recipe)
    found = capture(model, steps, name=args.model, recipe=recipe, candidates=True)
    try:
        found.save(args.output)
    except OSError as error:
        raise UserError(f"cannot write {args.output!r}: {error.strerror or error}") from None
    for step in found.steps:
        share = marked(f"{100 * step.share:.1f}%", share_problem(step.share))
        say(f"{step.name}: {step.step_ms:.3f} ms per step, norms {step.norm_ms:.4f} ms ({share})")
    rows = [(c.step, c.path, c.module_class, c.op, c.key, c.calls, c.casting, f"{c.offset:g}",
             f"{c.call_us:.1f}") for c in found.calls]
    print(tabulate(rows, headers=["step", "module", "class", "op", "key", "calls", "casting",
                                  "offset", "us/call"], tablefmt="simple"))
    for line in found.skip_lines():
        say(line)
    print_candidates(found)
    ops = sorted({c.op for c in found.calls} | {c.op for c in found.candidates})
    say(f"wrote {args.output} ({len(found.calls)} keys, {len(found.candidates)} fusion "
        "candidates); next: "
        + "; ".join(f"fusionlab sweep {op} --from-capture {args.output}" for op in ops))
    return 0


def print_candidates(found: Capture) -> None:
    """The fusion candidates, one row per step, chain and key, with their count per step and the
    norms' share of the step; then one line on the norms whose chain is unknown."""
    if found.candidates:
        print()
        print(tabulate(candidate_rows(found), headers=[
            "step", "kind", "sweep op", "key", "calls", "norms' share", "chain"
        ], tablefmt="simple"))
    unknown = ", ".join(found.untraced[:4]) + (", ..." if len(found.untraced) > 4 else "")
    if found.trace_problem:
        say(f"no fusion candidates: {found.trace_problem}; not found for {len(found.untraced)} "
            f"norm(s) ({unknown}); the norm calls above are captured from the modules")
    elif found.untraced:
        say(f"fusion candidates not looked for at {len(found.untraced)} norm(s) the "
            f"{found.traced} graph does not call as a module ({unknown})")


def candidate_rows(found: Capture) -> list[tuple[object, ...]]:
    """The candidates grouped by step, kind, op, key and chain: calls per step summed over the
    norms, and the share of the step those norms' own timed calls take."""
    groups: dict[tuple[str, str, str, str, str], list[FusionCandidate]] = {}
    for c in found.candidates:
        groups.setdefault((c.step, c.kind, c.op, c.key, c.pattern()), []).append(c)
    step_ms = {step.name: step.step_ms for step in found.steps}
    rows = []
    for (step, kind, op, key, pattern), members in groups.items():
        norm_ms = sum(c.calls * c.call_us for c in members) / 1e3
        share = norm_ms / step_ms[step] if step_ms.get(step) else 0.0
        rows.append((step, kind, op, key, sum(c.calls for c in members),
                     marked(f"{100 * share:.1f}%", share_problem(share)), pattern))
    return rows


def capture_shapes(op: str, path: str) -> tuple[str, str, int]:
    """The shapes, dtypes and thread count a capture recorded for an op (its norm calls, or the
    fusion candidates it computes), as sweep arguments."""
    get_op(op)
    found = Capture.load(path)
    keys = found.keys_of(op)
    if not keys:
        held = ", ".join(sorted({c.op for c in [*found.calls, *found.candidates]}))
        why = (f"; no fusion candidates were found: {found.trace_problem}" if found.trace_problem
               else "; fusion candidates were not looked for: capture(..., candidates=True)"
               if found.calls and not found.traced else "")
        raise UserError(f"capture {path!r} records no {op} calls (it holds "
                        f"{held or 'no norm calls'}){why}")
    shapes = sorted({shape for shape, _ in keys}, key=lambda s: (s[-1], len(s), s))
    dtypes = sorted({dtype for _, dtype in keys})
    return ",".join(format_shape(s) for s in shapes), ",".join(dtypes), found.threads

"""The six fusion configurations as a user reads them: a timing table and a logits and compile
table (each under 100 columns), the best configuration per step and how sure it is, then the
notes; every implausible figure is marked and explained."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from fusionlab.model.fusion_bench import EAGER, FusionResult, FusionRow, best_of
from fusionlab.plausible import marked, ratio_problem

WIDTH = 100


def render_fusion(result: FusionResult) -> str:
    """Both tables, one verdict line per step, and the footer."""
    notes: list[str] = []
    timing, accuracy = [], []
    for r in result.rows:
        if r.failed:
            timing.append([r.step, r.config, "-", "-", "not measured (see below)"])
            accuracy.append([r.step, r.config, "-", "-", "-"])
            notes.append(f"{r.step} {r.config}: not measured: {r.failed}")
            continue
        problems = _problems(r)
        notes += [f"disturbed: {r.step} {r.config}: {p}" for p in problems.values()]
        predicted = "-" if r.predicted is None else f"{r.predicted:.3f}x"
        gain = "1 (reference)" if r.config == EAGER else (
            f"{r.ratio:.3f}x [{r.low:.3f}, {r.high:.3f}]")
        timing.append([r.step, r.config, f"{r.median_ms:.3f}",
                       marked(predicted, problems.get("predicted", "")),
                       marked(gain, problems.get("gain", ""))])
        accuracy.append([r.step, r.config, f"{r.max_diff:.3g}",
                         f"{100 * r.argmax_agreement:.1f}%",
                         "-" if r.compile_ms is None else f"{r.compile_ms / 1e3:.2f}"])
    steps = list(dict.fromkeys(r.step for r in result.rows))
    verdicts = [_verdict(result.rows, step) for step in steps]
    if any(note.startswith("disturbed") for note in notes):
        notes.append("other processes disturbed these timings: run again on a quiet machine")
    reasons: dict[str, list[str]] = {}
    for name, why in result.no_prediction.items():
        reasons.setdefault(why, []).append(name)
    notes += [f"predicted '-' for {', '.join(names)}: {why}" for why, names in reasons.items()]
    sites = ", ".join(f"{name} {count}" for name, count in result.fused.items())
    notes.append(f"add + norm pairs fused (eager: layers; pass: most in one graph): {sites}")
    notes += [f"patched+fused ran {choice}" for choice in result.fused_choices]
    footer = (
        f"{result.runs} alternating rounds per step at {result.threads} thread(s), each "
        "configuration its own copy of the model, same inputs; compile = torch.compile with "
        f"{result.compile_backend}; patched = the norms' winners, patched+fused = also each "
        "layer's add + post-attention norm as one call, fused pass = fusionlab.backend fusing "
        "every add that feeds a norm. gain = eager median / this median, 95% bootstrap interval "
        "over the rounds; predicted = sum over the step's norm calls of calls x (naive chain - "
        "chosen variant) from the sweep results (fused: the add + norm naive chain against the "
        "fused winner); compile s = each compiled step's first call, apart from the rounds"
    )
    return "\n".join([
        tabulate(timing, headers=["step", "configuration", "median ms", "predicted",
                                  "measured gain vs eager [95% CI]"],
                 tablefmt="simple", disable_numparse=True),
        "",
        tabulate(accuracy, headers=["step", "configuration", "max |dlogits| vs eager",
                                    "argmax agree", "compile s"],
                 tablefmt="simple", disable_numparse=True),
        "",
        *(line for note in [*verdicts, footer, *notes]
          for line in textwrap.wrap(note, WIDTH, subsequent_indent="  ")),
    ])


def _problems(row: FusionRow) -> dict[str, str]:
    found = {
        "gain": ratio_problem(row.ratio, "measured gain"),
        "predicted": "" if row.predicted is None
        else row.predicted_problem or ratio_problem(row.predicted, "predicted gain"),
    }
    return {figure: problem for figure, problem in found.items() if problem}


def _verdict(rows: list[FusionRow], step: str) -> str:
    """The step's fastest configuration and whether the runner-up is distinguishable from it."""
    measured = [r for r in rows if r.step == step and not r.failed]
    if len(measured) < 2:
        return f"{step}: fewer than two configurations measured, no best"
    best, runner_up, (ratio, low, high) = best_of(rows, step)
    line = (f"{step}: best {best.config} ({best.median_ms:.3f} ms); runner-up {runner_up.config} "
            f"is {ratio:.3f}x [{low:.3f}, {high:.3f}] its time")
    mark = ratio_problem(ratio, "runner-up / best")
    if mark:
        return marked(line, mark) + f" ({mark})"
    if low <= 1.0 <= high:
        return line + ": not distinguishable from the runner-up"
    return line + ": faster than the runner-up at 95%"

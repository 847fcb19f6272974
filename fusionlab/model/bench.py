"""Prove a patch end to end: time the model patched and unpatched alternately, check the logits,
and set the gain predicted from the norms' own calls (timed inside the running step in this run,
see fusionlab.model.predict) beside the measured one; every figure is checked for plausibility."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tabulate import tabulate

from fusionlab.model.models import Step
from fusionlab.model.predict import CallTiming, time_in_situ
from fusionlab.plausible import marked, ratio_problem, saving_problem, share_problem

if TYPE_CHECKING:
    from fusionlab.model.patch_handle import PatchedModel

_RESAMPLES = 2000


@dataclass(frozen=True)
class StepResult:
    """One step, unpatched vs patched: medians, the gain with its 95% interval, the prediction."""

    step: str
    unpatched_ms: float
    patched_ms: float
    gain: float  # unpatched / patched medians
    low: float
    high: float
    predicted_saving_ms: float  # sum over the step's norm calls of (own - patched), this run
    norm_ms: float  # the step's norm calls at their own forward's call-level time, this run
    max_diff: float
    argmax_agreement: float
    runs: int
    calls: tuple[CallTiming, ...] = ()

    @property
    def norm_share(self) -> float:
        """The norms' share of the unpatched step, as measured in this run."""
        return self.norm_ms / self.unpatched_ms if self.unpatched_ms > 0 else 0.0

    @property
    def predicted_gain(self) -> float:
        return self.unpatched_ms / max(self.unpatched_ms - self.predicted_saving_ms, 1e-9)

    @property
    def predicted_inside(self) -> bool:
        """Whether the predicted gain lies within the measured 95% interval."""
        return self.low <= self.predicted_gain <= self.high

    def problems(self) -> dict[str, str]:
        """Figure -> why it cannot be true, for each implausible figure of the row."""
        least_saving = self.unpatched_ms * (1 - 1 / self.low) if self.low > 0 else 0.0
        found = {
            "share": share_problem(self.norm_share),
            "predicted": ratio_problem(self.predicted_gain, "predicted gain")
            or saving_problem(self.predicted_saving_ms, self.norm_ms, "predicted saving")
            or next((problem for c in self.calls if (problem := ratio_problem(
                c.own_us / max(c.patched_us, 1e-9), f"{c.module_class} at {c.key}: own/patched"
            ))), ""),  # the prediction is built from these call timings
            "gain": ratio_problem(self.gain, "measured gain")
            or saving_problem(least_saving, self.norm_ms, "measured saving (at least)"),
        }
        return {figure: problem for figure, problem in found.items() if problem}


def benchmark(handle: PatchedModel, steps: list[Step], runs: int = 30) -> list[StepResult]:
    """Per step: the norms' calls timed both ways inside the running step (the prediction), then
    alternating unpatched and patched runs of the whole step (same threads, same inputs; the
    order flips every run, so neither way always runs right after the other)."""
    results = []
    for step in steps:
        calls = tuple(time_in_situ(handle, step))
        with torch.no_grad():
            handle.undo()
            reference = step.run().float()
            handle.redo()
            patched = step.run().float()
            unpatched_s, patched_s = [], []
            for _ in range(2):  # warm-up of both paths
                for switch in (handle.undo, handle.redo):
                    switch()
                    step.run()
            for run in range(runs):
                ways = [(handle.undo, unpatched_s), (handle.redo, patched_s)]
                for switch, samples in ways[::-1] if run % 2 else ways:  # ABBA: no order bias
                    switch()
                    samples.append(timed_s(step.run))
            handle.redo()
        gain, low, high = paired_ratio(unpatched_s, patched_s)
        results.append(StepResult(
            step.name, 1e3 * statistics.median(unpatched_s), 1e3 * statistics.median(patched_s),
            gain, low, high, sum(c.calls * c.saving_us for c in calls) / 1e3,
            sum(c.calls * c.own_us for c in calls) / 1e3,
            (patched - reference).abs().max().item(),
            (patched.argmax(-1) == reference.argmax(-1)).float().mean().item(), runs, calls,
        ))
    return results


def timed_s(call: Callable[[], object]) -> float:
    """Wall seconds of one call, the device synchronised before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def paired_ratio(before: list[float], after: list[float], seed: int = 0) -> tuple[float, ...]:
    """median(before) / median(after) and a 95% bootstrap interval over the alternating pairs."""
    rng = random.Random(seed)
    n = len(before)
    ratios = []
    for _ in range(_RESAMPLES):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(
            statistics.median(before[i] for i in picks) / statistics.median(after[i] for i in picks)
        )
    ratios.sort()
    point = statistics.median(before) / statistics.median(after)
    return point, ratios[int(0.025 * _RESAMPLES)], ratios[int(0.975 * _RESAMPLES) - 1]


def render(results: list[StepResult], handle: PatchedModel) -> str:
    """The side-by-side table a user reads before and after patching; an implausible figure is
    marked and explained below the table."""
    table, notes = [], []
    functions = sum(1 for call in handle.capture.calls if call.source == "function")
    if functions:
        notes.append(f"{functions} norm key(s) called as functions, not modules, are in neither "
                     "the share nor the prediction")
    for r in results:
        problems = r.problems()
        notes += [f"disturbed: {r.step}: {problem}" for problem in problems.values()]
        table.append([
            r.step, marked(f"{100 * r.norm_share:.1f}%", problems.get("share", "")),
            marked(f"{r.predicted_saving_ms:.4f} ms -> {r.predicted_gain:.4f}x",
                   problems.get("predicted", "")),
            f"{r.unpatched_ms:.3f}", f"{r.patched_ms:.3f}",
            marked(f"{r.gain:.3f}x [{r.low:.3f}, {r.high:.3f}]", problems.get("gain", "")),
            "yes" if r.predicted_inside else "no", f"{r.max_diff:.3g}",
            f"{100 * r.argmax_agreement:.1f}%",
        ])
    header = ["step", "norm share", "predicted (saved -> gain)", "unpatched ms", "patched ms",
              "measured gain [95% CI]", "inside", "max |dlogits|", "argmax agree"]
    runs = results[0].runs if results else 0
    inside = sum(r.predicted_inside for r in results)
    if any(note.startswith("disturbed") for note in notes):
        notes.append("other processes disturbed these timings: run again on a quiet machine")
    return "\n".join([
        tabulate(table, headers=header, tablefmt="simple", disable_numparse=True),
        f"{runs} alternating runs per step at {torch.get_num_threads()} thread(s); predicted = "
        "sum over the step's norm calls of (own - patched forward), each timed inside the "
        "running step, paired runs in this run; norm share = those calls' own time / the unpatched "
        "step; gain = unpatched / patched median, 95% bootstrap interval over the pairs",
        f"{inside} of {len(results)} rows: predicted gain inside the measured 95% interval",
        *notes,
    ])

"""Prove a patch end to end: time the model patched and unpatched alternately, check the logits,
and set the gain the sweep predicted (calls x time saved) beside the measured one (Amdahl)."""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tabulate import tabulate

from fusionlab.model.models import Step
from fusionlab.report.tables import best_rows
from fusionlab.results import WinnerRow, WinnersFile
from fusionlab.search.results_store import load_cells
from fusionlab.search.storage import DEFAULT_STORAGE, open_storage
from fusionlab.shapes import format_shape

if TYPE_CHECKING:
    from fusionlab.model.patch import PatchHandle

_RESAMPLES = 2000
_TORCH_MODULES = ("LayerNorm", "RMSNorm")  # torch's own modules run the built-in lowering


@dataclass(frozen=True)
class StepResult:
    """One step, unpatched vs patched: medians, the gain with its 95% interval, the prediction."""

    step: str
    unpatched_ms: float
    patched_ms: float
    gain: float  # unpatched / patched medians
    low: float
    high: float
    predicted_saving_ms: float | None  # calls x time saved per call, from the sweep
    norm_share: float  # the captured norms' share of the unpatched step
    max_diff: float
    argmax_agreement: float
    runs: int

    @property
    def predicted_gain(self) -> float | None:
        if self.predicted_saving_ms is None:
            return None
        return self.unpatched_ms / max(self.unpatched_ms - self.predicted_saving_ms, 1e-9)


def benchmark(handle: PatchHandle, steps: list[Step], runs: int = 30) -> list[StepResult]:
    """Alternate unpatched and patched runs of every step (same threads, same inputs)."""
    results = []
    for step in steps:
        with torch.no_grad():
            handle.undo()
            reference = step.run().float()
            handle.redo()
            patched = step.run().float()
            unpatched_s, patched_s = [], []
            for _ in range(2):  # warm-up of both paths
                step.run()
            for _ in range(runs):
                handle.undo()
                unpatched_s.append(_time(step))
                handle.redo()
                patched_s.append(_time(step))
        gain, low, high = paired_ratio(unpatched_s, patched_s)
        capture_step = next((s for s in handle.capture.steps if s.name == step.name), None)
        results.append(StepResult(
            step.name, 1e3 * statistics.median(unpatched_s), 1e3 * statistics.median(patched_s),
            gain, low, high, predicted_saving_ms(handle, step.name),
            capture_step.share if capture_step else 0.0,
            (patched - reference).abs().max().item(),
            (patched.argmax(-1) == reference.argmax(-1)).float().mean().item(), runs,
        ))
    return results


def _time(step: Step) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    step.run()
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


def predicted_saving_ms(handle: PatchHandle, step: str) -> float | None:
    """Sum over the step's patched calls of calls x (what the module's lowering took in the sweep
    - what the winner took): the naive chain for model classes, the built-in for torch's own."""
    rows = _sweep_rows(handle)
    patched = {(r.path, r.key) for r in handle.rows if r.match != "fallback"}
    total, known = 0.0, False
    for call in handle.capture.calls:
        if call.step != step or (call.path, call.key) not in patched:
            continue
        row = rows.get((call.op, format_shape(call.shape), call.dtype))
        if row is None or row.median_ms is None:
            continue
        versus = "builtin" if call.module_class in _TORCH_MODULES else "baseline"
        speedup = getattr(row, f"speedup_vs_{versus}")
        if speedup:
            total += call.calls * row.median_ms * (speedup - 1.0)
            known = True
    return total if known else None


def _sweep_rows(handle: PatchHandle) -> dict[tuple[str, str, str], WinnerRow]:
    """The sweep's table rows for this machine and thread count, by (op, shape, dtype)."""
    source = handle.winners_source
    ops = {m.op for m in handle.modules}
    rows: list[tuple[str, WinnerRow]] = []
    for op in ops:
        winners = source["winners"]
        if isinstance(winners, dict):
            winners = winners.get(op)
        if winners is not None:
            data = json.loads(Path(winners).read_text(encoding="utf-8"))
            rows += [(op, row) for row in WinnersFile.from_dict(data).rows]
        else:
            cells = load_cells(open_storage(source["storage"] or DEFAULT_STORAGE), op)
            rows += [(op, row) for row in best_rows(cells, source["rank_by"], None)]
    threads = torch.get_num_threads()
    return {
        (op, row.shape, row.dtype): row for op, row in rows if row.threads in (0, threads)
    }


def render(results: list[StepResult], handle: PatchHandle) -> str:
    """The side-by-side table a user reads before and after patching."""
    table = []
    for r in results:
        predicted = "-" if r.predicted_gain is None else (
            f"{r.predicted_saving_ms:.4f} ms -> {r.predicted_gain:.4f}x"
        )
        table.append([
            r.step, f"{100 * r.norm_share:.1f}%", predicted, f"{r.unpatched_ms:.3f}",
            f"{r.patched_ms:.3f}", f"{r.gain:.3f}x [{r.low:.3f}, {r.high:.3f}]",
            f"{r.max_diff:.3g}", f"{100 * r.argmax_agreement:.1f}%",
        ])
    header = ["step", "norm share", "predicted (saved -> gain)", "unpatched ms", "patched ms",
              "measured gain [95% CI]", "max |dlogits|", "argmax agree"]
    runs = results[0].runs if results else 0
    return (
        tabulate(table, headers=header, tablefmt="simple", disable_numparse=True)
        + f"\n{runs} alternating runs per step at {torch.get_num_threads()} thread(s); predicted ="
        " sum of calls x (the module's lowering - the winner) from the sweep; gain = unpatched /"
        " patched median, 95% bootstrap interval over the pairs"
    )


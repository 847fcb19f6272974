"""Prove a training patch end to end: the patched model and an unpatched copy with identical
weights, each with its own AdamW, train on the same batches; every parameter's gradient of the
first step is compared, then full training steps (forward, loss, backward, optimizer) are timed
alternately, then each one's peak memory over one step is measured. The prediction is the norms'
own calls timed forward and backward both ways (fusionlab.model.predict)."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tabulate import tabulate

from fusionlab.errors import UserError
from fusionlab.measure.peak_memory import MemoryUse, memory_use
from fusionlab.model.bench import StepResult, paired_ratio
from fusionlab.model.grad_check import GradientGroup, compare_gradients
from fusionlab.model.predict import time_calls
from fusionlab.model.train import (
    Trainer,
    check_lengths,
    next_token_loss,
    token_batches,
    trainable_parameters,
)
from fusionlab.plausible import marked

if TYPE_CHECKING:
    from fusionlab.model.patch_handle import PatchedModel

_WARMUP = 2  # full steps of each model after the checked one, before timing
DIFFERS = " [differs]"


@dataclass(frozen=True)
class TrainResult:
    """One training step, unpatched vs patched: times, prediction, peak memory, gradients."""

    timing: StepResult  # its max_diff / argmax_agreement: the checked step's logits
    unpatched: MemoryUse  # peak: of a whole step; retained: kept from forward for backward
    patched: MemoryUse
    gradients: list[GradientGroup]
    losses: tuple[float, float]  # the checked step's loss, unpatched and patched

    @property
    def gradients_ok(self) -> bool:
        return all(group.ok for group in self.gradients)


def benchmark_training(handle: PatchedModel, tokens: list[int], runs: int = 20, seed: int = 0,
                       lr: float = 1e-4) -> list[TrainResult]:
    """Per sequence length: the training step patched against an unpatched copy. The model's
    weights, gradients and train/eval mode are as before when it returns."""
    if handle.mode != "training":
        raise UserError("benchmark_training needs a model patched with mode='training'")
    model = handle.model
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise UserError(f"{type(model).__name__} is not a transformers causal LM: a training "
                        "step needs token ids and next-token targets")
    trainable_parameters(model)
    check_lengths(tokens)
    saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
    was_training = model.training
    try:
        return [_one_length(handle, n, len(tokens) > 1, runs, seed, lr) for n in tokens]
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def _one_length(handle: PatchedModel, tokens: int, named: bool, runs: int, seed: int,
                lr: float) -> TrainResult:
    model = handle.model
    suffix = f"@{tokens}" if named else ""
    calls = tuple(time_calls(handle, "prefill" + suffix, train=True))
    handle.undo()
    twin = copy.deepcopy(model)  # identical weights, never patched
    handle.redo()
    batches = token_batches(model.config.vocab_size, tokens, _WARMUP + runs + 2, seed)
    unpatched, patched = (Trainer(m.train(), batches, seed, lr) for m in (twin, model))
    logits_u, logits_p = unpatched.backward(0), patched.backward(0)
    gradients = compare_gradients(model, twin)
    losses = tuple(next_token_loss(logits, batches[0]).item() for logits in (logits_u, logits_p))
    for trainer in (unpatched, patched):
        trainer.optimizer.step()  # the checked step completed
        for index in range(1, _WARMUP + 1):
            trainer.step(index)
    unpatched_s, patched_s = [], []
    for run in range(runs):
        pair = [(unpatched, unpatched_s), (patched, patched_s)]
        for trainer, samples in pair[::-1] if run % 2 else pair:
            samples.append(_time(trainer, _WARMUP + 1 + run))
    memory = [_memory(trainer, len(batches) - 1, logits_u.device)
              for trainer in (unpatched, patched)]
    gain, low, high = paired_ratio(unpatched_s, patched_s)
    timing = StepResult(
        "train" + suffix, 1e3 * statistics.median(unpatched_s), 1e3 * statistics.median(patched_s),
        gain, low, high, sum(c.calls * c.saving_us for c in calls) / 1e3,
        sum(c.calls * c.own_us for c in calls) / 1e3,
        (logits_p.float() - logits_u.float()).abs().max().item(),
        (logits_p.argmax(-1) == logits_u.argmax(-1)).float().mean().item(), runs, calls,
    )
    return TrainResult(timing, memory[0], memory[1], gradients, losses)


def _memory(trainer: Trainer, index: int, device: torch.device) -> MemoryUse:
    """The peak of a whole step, and what its forward keeps for backward (the logits and loss
    included), on the same batch; gradients set to None first, so that nothing allocated before
    is freed inside."""
    trainer.model.zero_grad(set_to_none=True)
    kept = memory_use(lambda: trainer.forward(index), device).retained
    step = memory_use(lambda: trainer.step(index), device).peak
    return MemoryUse(step, kept)


def _time(trainer: Trainer, index: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    trainer.step(index)
    sync()
    return time.perf_counter() - start


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f}"


def render_training(results: list[TrainResult]) -> str:
    """The training steps' table, then each step's gradient check, then notes; an implausible
    timing is marked [disturbed], a gradient beyond its tolerance [differs]."""
    table, notes = [], []
    for result in results:
        r = result.timing
        problems = r.problems()
        notes += [f"disturbed: {r.step}: {problem}" for problem in problems.values()]
        predicted = (marked(f"{r.predicted_saving_ms:.3f} ms -> {r.predicted_gain:.4f}x",
                            problems.get("predicted", "")) if r.calls else "n/a")
        table.append([
            r.step, f"{100 * r.norm_share:.1f}%" if r.calls else "n/a", predicted,
            f"{r.unpatched_ms:.2f}", f"{r.patched_ms:.2f}",
            marked(f"{r.gain:.3f}x [{r.low:.3f}, {r.high:.3f}]", problems.get("gain", "")),
            ("yes" if r.predicted_inside else "no") if r.calls else "n/a",
            f"{_mib(result.unpatched.retained)} / {_mib(result.patched.retained)}",
            f"{_mib(result.unpatched.peak)} / {_mib(result.patched.peak)}",
        ])
    header = ["step", "norm share", "predicted (saved -> gain)", "unpatched ms", "patched ms",
              "measured gain [95% CI]", "inside", "kept for backward MiB", "peak MiB"]
    lines = [tabulate(table, headers=header, tablefmt="simple", disable_numparse=True)]
    runs = results[0].timing.runs if results else 0
    lines.append(
        f"{runs} alternating training steps (forward, next-token cross-entropy, backward, AdamW) "
        f"per row at {torch.get_num_threads()} thread(s), after {_WARMUP + 1} of each; "
        "predicted = sum over the norm calls of (own - patched forward+backward), paired rounds in "
        "this run; MiB unpatched / patched, of the torch allocator beyond what was live before: "
        "kept for backward = live after forward and loss (saved tensors, logits); peak = the most "
        "live during one step (activations, gradients, temporaries; not the weights or the "
        "optimizer state)"
    )
    for result in results:
        lines += ["", _render_gradients(result)]
    if notes:
        notes.append("other processes disturbed these timings: run again on a quiet machine")
    return "\n".join(lines + notes)


def _render_gradients(result: TrainResult) -> str:
    rows = [[g.name, g.parameters,
             f"{g.max_relative:.3g}" + ("" if g.ok else DIFFERS), f"{g.tolerance:.3g}", g.worst]
            for g in result.gradients]
    unpatched, patched = result.losses
    return "\n".join([
        f"{result.timing.step}: gradients after one step from identical weights (loss "
        f"{unpatched:.6g} unpatched, {patched:.6g} patched; max |dlogits| "
        f"{result.timing.max_diff:.3g})",
        tabulate(rows, headers=["parameters", "count", "max rel diff", "tolerance", "worst"],
                 tablefmt="simple", disable_numparse=True),
    ])


def gradient_warnings(results: list[TrainResult]) -> list[str]:
    """One line per parameter group whose patched gradient is beyond its tolerance."""
    return [
        f"gradients differ: {r.timing.step}: {g.name} max relative difference "
        f"{g.max_relative:.3g} > {g.tolerance:.3g} (worst {g.worst}): the patched norms' "
        "backward does not match the model's own"
        for r in results for g in r.gradients if not g.ok
    ]

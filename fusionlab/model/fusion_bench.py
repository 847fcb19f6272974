"""Residual add + norm fusion against the alternatives, side by side in one run: six
configurations of one model, each its own copy, timed in alternating rounds on the same inputs
and threads (each round starts at the next configuration), with the logits compared against eager
unpatched and the compile time (each compiled step's first call) kept apart from the rounds."""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusionlab.model.bench import paired_ratio, timed_s
from fusionlab.model.capture import Capture
from fusionlab.model.fused_add_norm import FUSED_OPS
from fusionlab.model.fusion_pass import FusionBackend, backend
from fusionlab.model.models import Step
from fusionlab.model.patch import PatchHandle, patch
from fusionlab.model.sweep_saving import Times, predicted_saving, sweep_times

EAGER = "eager"
CONFIGS = (EAGER, "patched", "patched+fused", "compile", "compile+patched", "compile+fused pass")
COMPILE_BACKENDS = ("inductor", "eager")  # eager: dynamo's graphs run as traced (fast, tests)
COMPILED_NO_PREDICTION = (
    "no prediction for compiled configurations: the compiler generates its own code around and "
    "inside the norms, which no sweep timed"
)


@dataclass
class Patching:
    """Where the winners come from, as `patch()` takes them."""

    capture: Capture
    storage: str | None = None
    winners: str | None = None
    ops: list[str] | None = None


@dataclass
class Configuration:
    """One configuration's own model copy, its steps, and why it could not run (if so)."""

    name: str
    handle: PatchHandle | None = None
    fusing: FusionBackend | None = None
    steps: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    compile_ms: dict[str, float] = field(default_factory=dict)
    failed: str = ""


@dataclass(frozen=True)
class FusionRow:
    """One configuration at one step."""

    step: str
    config: str
    samples_ms: tuple[float, ...] = ()
    ratio: float = 0.0  # eager median / this median
    low: float = 0.0
    high: float = 0.0
    predicted: float | None = None  # predicted gain vs eager
    max_diff: float = 0.0
    argmax_agreement: float = 0.0
    compile_ms: float | None = None
    failed: str = ""
    predicted_problem: str = ""  # why a sweep figure behind the prediction is implausible

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else 0.0


@dataclass(frozen=True)
class FusionResult:
    """All rows, why a prediction is missing, and how many rounds ran at how many threads."""

    rows: list[FusionRow]
    runs: int
    threads: int
    compile_backend: str
    no_prediction: dict[str, str]  # configuration -> why its predicted gain is "-"
    fused: dict[str, int]  # configuration -> fused add + norm calls in its model (or graph)
    fused_choices: list[str]  # eager fusion: each key's fused variant (or why apart), once


def measure_fusion(model: nn.Module, steps_of: Callable[[nn.Module], list[Step]],
                   patching: Patching, runs: int, compile_backend: str = "inductor",
                   say: Callable[[str], None] = lambda _: None) -> FusionResult:
    """Build the six configurations of `model` (copies; the model itself is not touched), time
    them at each of `steps_of(copy)`'s steps, and predict the eager ones' gains."""
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are in the patch report printed before
        configs = [_build(model, steps_of, patching, name, compile_backend) for name in CONFIGS]
        for config in configs:
            if config.failed:
                say(f"{config.name}: not measured: {config.failed}")
        rows = [row for step in configs[0].steps
                for row in _time_step(configs, step, runs)]
    torch._dynamo.reset()
    no_prediction: dict[str, str] = {}
    times = _sweep_times(configs, patching)
    rows = [_with_prediction(row, configs, times, rows, no_prediction) for row in rows]
    return FusionResult(rows, runs, torch.get_num_threads(), compile_backend, no_prediction,
                        _fused_counts(configs), _fused_choices(configs))


def _fused_choices(configs: list[Configuration]) -> list[str]:
    """What the eager fused layers ran at each key, each distinct choice once."""
    handle = next(c.handle for c in configs if c.name == "patched+fused")
    rows = [r for layer in handle.layers for r in layer.add_norm.rows] if handle else []
    return list(dict.fromkeys(f"{r.op} at {r.key}: {r.variant} [{r.match}] {r.numerics} {r.why}"
                              .rstrip() for r in rows))


def _fused_counts(configs: list[Configuration]) -> dict[str, int]:
    """Eager: the layers whose add + norm run as one call; the pass: the most add + norm pairs
    it rewrote in one graph."""
    counts = {}
    for config in configs:
        if config.fusing is not None:
            counts[config.name] = max(config.fusing.rewrites, default=0)
        elif config.handle is not None and config.handle.layers:
            counts[config.name] = len(config.handle.layers)
    return counts


def _build(model: nn.Module, steps_of: Callable[[nn.Module], list[Step]], patching: Patching,
           name: str, compile_backend: str) -> Configuration:
    config = Configuration(name)
    own = copy.deepcopy(model)
    if "patched" in name:
        config.handle = patch(own, patching.capture, storage=patching.storage,
                              winners=patching.winners, ops=patching.ops,
                              fuse=name.endswith("fused"))
    target: nn.Module = own
    if name.startswith("compile"):
        compiler: Any = compile_backend
        if name.endswith("fused pass"):
            winners = None if patching.winners is None else dict.fromkeys(
                FUSED_OPS.values(), patching.winners)
            config.fusing = compiler = backend(storage=patching.storage, winners=winners,
                                               inductor=compile_backend == "inductor")
        target = torch.compile(own, backend=compiler)
    try:
        steps = steps_of(target)  # a causal LM's first call fills its cache: not timed
        config.steps = {step.name: step.run for step in steps}
        if name.startswith("compile"):  # the compile time, apart from the rounds
            config.compile_ms = {step.name: 1e3 * timed_s(step.run) for step in steps}
    except Exception as error:  # dynamo or the compiler may raise anything on the model's code
        if not name.startswith("compile"):
            raise
        text = " ".join(str(error).split())[:160]
        config.failed = f"torch.compile could not run the model ({type(error).__name__}: {text})"
    return config


def _time_step(configs: list[Configuration], step: str, runs: int) -> list[FusionRow]:
    """Warm-up, logits, then `runs` rounds over the configurations that run."""
    running = [c for c in configs if not c.failed]
    logits = {c.name: c.steps[step]().float() for c in running}
    samples: dict[str, list[float]] = {c.name: [] for c in running}
    for config in running:  # warm-up
        config.steps[step]()
    for round_index in range(runs):
        start = round_index % len(running)
        for config in running[start:] + running[:start]:
            samples[config.name].append(1e3 * timed_s(config.steps[step]))
    reference = logits[EAGER]
    rows = []
    for config in configs:
        if config.failed:
            rows.append(FusionRow(step, config.name, failed=config.failed))
            continue
        ratio, low, high = paired_ratio(samples[EAGER], samples[config.name])
        mine = logits[config.name]
        rows.append(FusionRow(
            step, config.name, tuple(samples[config.name]), ratio, low, high, None,
            (mine - reference).abs().max().item(),
            (mine.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            config.compile_ms.get(step),
        ))
    return rows


def _sweep_times(configs: list[Configuration], patching: Patching) -> Times | None:
    """The sweep figures the eager configurations' predictions use, read once (None from a
    winners file)."""
    handles = [c.handle for c in configs
               if c.handle is not None and not c.name.startswith("compile")]
    if patching.storage is None or not handles:
        return None
    device = next((p.device.type for p in handles[0].model.parameters()), "cpu")
    ops = {r.op for handle in handles for r in handle.all_rows()}
    return sweep_times(patching.storage, ops, torch.get_num_threads(), device)


def _with_prediction(row: FusionRow, configs: list[Configuration], times: Times | None,
                     rows: list[FusionRow], why: dict[str, str]) -> FusionRow:
    """The row with its predicted gain, or as it is with the reason noted in `why`."""
    if row.failed or row.config == EAGER:
        return row
    if row.config.startswith("compile"):
        why[row.config] = COMPILED_NO_PREDICTION
        return row
    if times is None:
        why[row.config] = "no prediction from a winners file: it holds no naive-chain timings"
        return row
    handle = next(c.handle for c in configs if c.name == row.config)
    assert handle is not None
    prediction = predicted_saving(handle, row.step, times)
    if prediction.saving_ms is None:
        why[row.config] = prediction.why_none
        return row
    eager_ms = next(r.median_ms for r in rows if r.step == row.step and r.config == EAGER)
    gain = eager_ms / max(eager_ms - prediction.saving_ms, 1e-9)
    return FusionRow(row.step, row.config, row.samples_ms, row.ratio, row.low, row.high, gain,
                     row.max_diff, row.argmax_agreement, row.compile_ms,
                     predicted_problem=prediction.problem)


def best_of(rows: list[FusionRow], step: str) -> tuple[FusionRow, FusionRow, tuple[float, ...]]:
    """The fastest configuration of a step by median, the runner-up, and runner-up / best as a
    paired ratio with its 95% interval."""
    ranked = sorted((r for r in rows if r.step == step and not r.failed),
                    key=lambda r: r.median_ms)
    best, runner_up = ranked[0], ranked[1]
    return best, runner_up, paired_ratio(list(runner_up.samples_ms), list(best.samples_ms))


"""Capture a model's norm calls: run it once with hooks on its norm modules (and a function mode
for functional calls), record every call's key and numerics, then time the model without hooks and
each norm call on its own, so each op's share of the step is known before anything is patched.
Then trace the first step's graph for the fusion candidates around the norms
(fusionlab/model/candidates.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fusionlab.errors import UserError
from fusionlab.measure.stats import summarise
from fusionlab.model.candidates import FusionCandidate, find_candidates
from fusionlab.model.models import Step, module_steps
from fusionlab.model.norm_call import NormCall
from fusionlab.model.norms import SkippedNorm, inspect_norm, norm_op, unrecognised_norms
from fusionlab.registry import op_names
from fusionlab.shapes import DTYPES, format_shape, parse_shape

FORMAT = "fusionlab-capture"
VERSION = 2  # 2 adds the fusion candidates
_READABLE = (1, 2)
_BEFORE_CANDIDATES = ("the file is version 1, written before capture recorded fusion candidates: "
                      "capture the model again")
_FUNCTIONS: dict[Callable[..., Any], str] = {
    F.layer_norm: "layernorm",
    torch.layer_norm: "layernorm",
    F.rms_norm: "rmsnorm",
    torch.rms_norm: "rmsnorm",
}


@dataclass(frozen=True)
class StepTime:
    """A model step's median time without hooks, and the captured norms' time within it."""

    name: str
    step_ms: float
    norm_ms: float

    @property
    def share(self) -> float:
        return self.norm_ms / self.step_ms if self.step_ms > 0 else 0.0


@dataclass
class Capture:
    """What `capture` found: the model's norm calls and the steps' times."""

    model: str
    device: str
    threads: int
    steps: list[StepTime]
    calls: list[NormCall]
    ops: list[str] = field(default_factory=op_names)
    # how to make the model again (`bench-model` reads it): model (a preset, a folder or
    # module:function), config, dtype, tokens (prompt lengths), seed, inputs (module:function)
    recipe: dict[str, Any] = field(default_factory=dict)
    skipped: list[SkippedNorm] = field(default_factory=list)  # norm-like modules not recorded
    candidates: list[FusionCandidate] = field(default_factory=list)
    traced: str = ""  # the step whose graph the candidates come from ("" when none was traced)
    trace_problem: str = ""  # why no graph was read ("" when it was, or was not asked for)
    untraced: list[str] = field(default_factory=list)  # norms whose chain is unknown

    def skip_lines(self) -> list[str]:
        """One line per module that looks like a norm and was not recorded, saying why."""
        return [f"not recognised: {s.path or 'the root'} ({s.module_class}): {s.why}"
                for s in self.skipped]

    def of_op(self, op: str) -> list[NormCall]:
        return [call for call in self.calls if call.op == op]

    def keys_of(self, op: str) -> list[tuple[tuple[int, ...], str]]:
        """The (shape, dtype) keys at which the model calls an op: its own norm calls, and the
        fusion candidates that op computes (add_rmsnorm for an add + RMSNorm...)."""
        keys = [(c.shape, c.dtype) for c in self.of_op(op)]
        keys += [(c.shape, c.dtype) for c in self.candidates if c.op == op]
        return list(dict.fromkeys(keys))

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "device": self.device,
            "threads": self.threads,
            "ops": self.ops,
            "recipe": self.recipe,
            "steps": [asdict(step) for step in self.steps],
            "calls": [{**asdict(c), "shape": format_shape(c.shape)} for c in self.calls],
            "skipped": [asdict(s) for s in self.skipped],
            "traced": self.traced,
            "trace_problem": self.trace_problem,
            "untraced": self.untraced,
            "candidates": [{**asdict(c), "shape": format_shape(c.shape)}
                           for c in self.candidates],
        }
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Capture:
        """A capture file, checked: its format, version, and that this install knows its ops."""
        hint = "write it again with `fusionlab capture`"
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or data.get("version") not in _READABLE:
                versions = " or ".join(map(str, _READABLE))
                raise ValueError(f"not a {FORMAT} file of version {versions}")
            candidates = [_candidate(c) for c in data.get("candidates", [])]
            unknown = sorted(({c["op"] for c in data["calls"]} | {c.op for c in candidates})
                             - set(op_names()))
            if unknown:
                raise UserError(
                    f"capture {str(path)!r} records ops this install does not have "
                    f"({', '.join(unknown)}; known: {', '.join(op_names())}): load the plugin "
                    f"that registers them, or {hint}"
                )
            calls = [
                NormCall(**{**c, "shape": parse_shape(c["shape"])}) for c in data["calls"]
            ]
            if any(item.dtype not in DTYPES for item in [*calls, *candidates]):
                raise ValueError("unknown dtype in calls")
            return cls(
                data["model"], data["device"], int(data["threads"]),
                [StepTime(**step) for step in data["steps"]], calls, list(data["ops"]),
                dict(data.get("recipe") or {}),
                [SkippedNorm(**s) for s in data.get("skipped", [])], candidates,
                str(data.get("traced", "")),
                str(data.get("trace_problem", "") if data["version"] > 1 else _BEFORE_CANDIDATES),
                [str(path) for path in data.get("untraced", [])],
            )
        except UserError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise UserError(
                f"capture file {str(path)!r} is unreadable ({type(error).__name__}: {error}); "
                f"{hint}"
            ) from None


def capture(model: nn.Module, inputs: Any, *, name: str = "", repeats: int = 20,
            recipe: dict[str, Any] | None = None, candidates: bool = False) -> Capture:
    """Run the model once with hooks (recording every norm call), then time it without hooks and
    each norm call on its own. `inputs`: example inputs (a tensor, tuple or dict of keyword
    arguments), or steps such as `causal_lm_steps(model, tokens)` (prefill and decode).
    `recipe`: how `bench-model` makes the model again, e.g. {"model": "mymodels:build",
    "inputs": "mymodels:example"} (see Capture.recipe). `candidates`: also trace the first
    step's graph with dynamo for the fusion candidates around the norms (seconds on a large
    model; `fusionlab capture` always does; without it `Capture.candidates` stays empty)."""
    steps = inputs if _are_steps(inputs) else module_steps(model, inputs)
    device = _device_of(model)
    recorder = _Recorder(model)
    with recorder.hooks():
        for step in steps:
            recorder.step = step.name
            _run(step)
    calls = recorder.calls(repeats)
    skipped = unrecognised_norms(model) + recorder.skipped
    skipped += _not_called(model, {c.path for c in calls if c.source == "module"}
                           | {s.path for s in skipped})
    times = []
    for step in steps:
        step_ms = 1e3 * _median_s(lambda step=step: _run(step), repeats)
        norm_us = sum(c.calls * c.call_us for c in calls if c.step == step.name)
        times.append(StepTime(step.name, step_ms, norm_us / 1e3))
    found = Capture(name or type(model).__name__, device, torch.get_num_threads(), times, calls,
                    recipe=dict(recipe or {}), skipped=skipped)
    if candidates:
        search = find_candidates(model, steps[0], calls)
        found.candidates, found.traced = search.candidates, search.traced
        found.trace_problem, found.untraced = search.problem, search.untraced
    return found


def _candidate(data: dict[str, Any]) -> FusionCandidate:
    """A fusion candidate as the capture file holds it."""
    return FusionCandidate(**{
        **data, "shape": parse_shape(data["shape"]),
        "casts_before": tuple(data.get("casts_before", ())),
        "casts_after": tuple(data.get("casts_after", ())),
    })


def _not_called(model: nn.Module, seen: set[str]) -> list[SkippedNorm]:
    """Recognised norms that no captured step called: nothing is known of their keys."""
    return [SkippedNorm(path, type(module).__name__, "not called by the captured steps")
            for path, module in model.named_modules()
            if norm_op(module) is not None and path not in seen]


def _are_steps(inputs: Any) -> bool:
    return isinstance(inputs, list) and bool(inputs) and all(isinstance(s, Step) for s in inputs)


def _device_of(model: nn.Module) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


def _run(step: Step) -> torch.Tensor:
    """One step under no_grad; any failure of the model is the user's to fix, in one line."""
    try:
        with torch.no_grad():
            return step.run()
    except UserError:
        raise
    except Exception as error:  # the model's own code may raise anything
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserError(
            f"the model's {step.name} step failed ({type(error).__name__}: {text[:200]}); give "
            "example inputs the model accepts (shape, dtype, device)"
        ) from None


def _median_s(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of a call after two warm-up calls (the CPU runs synchronously; on an
    accelerator the device is synchronised before each clock read)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(2):
        call()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        samples.append(time.perf_counter() - start)
    return summarise(samples).median


@dataclass
class _Seen:
    module: nn.Module | None
    module_class: str
    source: str
    op: str
    replay: Callable[[], object]
    sample: torch.Tensor
    eps: float | None
    calls: int = 0


class _Recorder(TorchFunctionMode):
    """Module hooks on known norms; a function mode for norms called as functions elsewhere."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.step = ""
        self._stack: list[str] = []
        self._inside_norm = 0
        self._seen: dict[tuple[str, str, str, tuple[int, ...], str], _Seen] = {}
        self.skipped: list[SkippedNorm] = []  # recognised by class, but no formula matched

    @contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        for path, module in self.model.named_modules():
            op = norm_op(module)
            handles.append(module.register_forward_pre_hook(self._enter(path, module, op)))
            handles.append(module.register_forward_hook(self._leave(op is not None),
                                                        always_call=True))
        try:
            with self:
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, path: str, module: nn.Module, op: str | None) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            self._stack.append(path)
            if op is not None:
                self._inside_norm += 1
                x = args[0] if args else None
                if isinstance(x, torch.Tensor):
                    sample = x.detach().clone()
                    self._note(path, module, "module", op, sample,
                               lambda: module(sample), None)

        return hook

    def _leave(self, is_norm: bool) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self._stack.pop()
            if is_norm:
                self._inside_norm -= 1

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _FUNCTIONS.get(func)
        if op is not None and not self._inside_norm and args and isinstance(args[0], torch.Tensor):
            saved = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            eps = kwargs.get("eps", args[-1] if isinstance(args[-1], float) else None)
            path = self._stack[-1] if self._stack else ""
            self._note(path, None, "function", op, saved[0],
                       lambda: func(*saved, **kwargs), eps)
        return func(*args, **kwargs)

    def _note(self, path: str, module: nn.Module | None, source: str, op: str,
              sample: torch.Tensor, replay: Callable[[], object], eps: float | None) -> None:
        dtype = next(name for name, value in DTYPES.items() if value == sample.dtype)
        key = (path, source, self.step, tuple(sample.shape), dtype)
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _Seen(
                module, type(module).__name__ if module is not None else "function", source, op,
                replay, sample, eps,
            )
        seen.calls += 1

    def calls(self, repeats: int) -> list[NormCall]:
        """Every recorded key with its numerics and the median time of one call."""
        result = []
        unknown: set[str] = set()
        for (path, source, step, shape, dtype), seen in self._seen.items():
            if seen.module is not None:
                info = inspect_norm(seen.module, seen.sample)
                eps, casting, offset = info.eps, info.casting, info.offset
                if casting == "unknown":
                    if path not in unknown:
                        unknown.add(path)
                        self.skipped.append(SkippedNorm(path, seen.module_class, (
                            f"its output at {format_shape(shape)} {dtype} matches no {seen.op} "
                            "formula fusionlab computes (none, llama or gemma casting)"
                        )))
                    continue
            else:
                eps, casting, offset = float(seen.eps or 0.0), "none", 0.0
            with torch.no_grad():
                call_us = 1e6 * _median_s(seen.replay, repeats)
            result.append(NormCall(
                path, seen.module_class, source, seen.op, step, shape, dtype,
                seen.sample.device.type, eps, casting, offset, seen.calls, call_us,
            ))
        return result

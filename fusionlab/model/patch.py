"""Patch a model's captured norm modules with the winners: each module's forward becomes a table
lookup (shape, dtype) -> chosen kernel, resolved and checked against the module's own output once
per key. Nothing is changed until every module is resolved, so a failed patch changes nothing.

In 16-bit dtypes a kernel must reproduce the module bit for bit (on the input and on a probe of
many rows); one that does not gives way to the next fastest variant of the cell that does. Under
torch.compile the forward is one opaque op call (fusionlab/model/patched_op.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.bench import benchmark
from fusionlab.model.capture import Capture
from fusionlab.model.fuse import FusedLayer, fuse_layers
from fusionlab.model.norm_call import NormCall
from fusionlab.model.norms import (
    SkippedNorm,
    inspect_norm,
    looks_like_norm,
    norm_op,
    why_not_recognised,
)
from fusionlab.model.patch_handle import PatchedModel
from fusionlab.model.patched_module import (
    PatchedModule,
    PatchRow,
    build_kernel,
    check_numerics_exist,
    must_be_exact,
    numerics_text,
    params_text,
    probe_rows,
    supports,
)
from fusionlab.model.train_bench import benchmark_training
from fusionlab.registry import Kernel, get_op, get_variant, variants_of
from fusionlab.runtime import Choice, Dispatcher
from fusionlab.search.storage import DEFAULT_STORAGE
from fusionlab.shapes import DTYPES, dtype_name, format_shape

MODES = ("inference", "training")
_FUSION_NOTE = (
    "not fused: each residual add runs apart from the norm after it; patch(..., fuse=True) runs "
    "the add after the attention and the norm after it as one add_rmsnorm / add_layernorm call"
)


class PatchHandle(PatchedModel):
    """The patched model: `.report()`, `.undo()`, `.benchmark(...)`."""

    def benchmark(self, steps: list[Any], runs: int = 30) -> Any:
        """Time the model patched and unpatched alternately (see fusionlab.model.bench)."""
        return benchmark(self, steps, runs)

    def benchmark_training(self, tokens: list[int], runs: int = 20, seed: int = 0) -> Any:
        """Time training steps patched against an unpatched copy, compare their gradients and
        peak memory (see fusionlab.model.train_bench)."""
        return benchmark_training(self, tokens, runs, seed)


def patch(
    model: nn.Module,
    capture: Capture | str | None = None,
    *,
    storage: str | None = None,
    winners: str | dict[str, str] | None = None,
    ops: list[str] | None = None,
    mode: str = "inference",
    rank_by: str = "cold",
    fuse: bool = False,
) -> PatchHandle:
    """Replace each captured norm module's forward with the winner for its keys.

    `winners`: a winners file (`fusionlab export OP --format json`), or {op: file}; else
    `storage`. A key whose winner is missing, disagrees with the module or lacks its numerics
    keeps the module's own forward (a warning says why). Without a capture, every norm module
    capture would find is patched and each key is resolved on its first call.
    `fuse`: also run each decoder layer's residual add after the attention and the norm after it
    as one add_rmsnorm / add_layernorm call (fusionlab/model/fuse.py)."""
    if mode not in MODES:
        raise UserError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    return _patch_norms(model, capture, storage, winners, ops, mode, rank_by, fuse)


def _fused_layers(model: nn.Module, storage: str | None, winners: str | dict[str, str] | None,
                  mode: str, rank_by: str) -> tuple[list[FusedLayer], list[str]]:

    return fuse_layers(model, lambda op: _dispatcher(op, storage, winners, rank_by, mode), mode)


def _patch_norms(model: nn.Module, capture: Capture | str | None, storage: str | None,
                 winners: str | dict[str, str] | None, ops: list[str] | None, mode: str,
                 rank_by: str, fuse: bool) -> PatchHandle:
    layers, notes = _fused_layers(model, storage, winners, mode, rank_by) if fuse else ([], [])
    if capture is None:
        return _patch_found_norms(model, storage, winners, ops, mode, rank_by, layers, notes)
    if isinstance(capture, str):
        capture = Capture.load(capture)
    calls = _replaceable_calls(capture, ops)
    dispatchers = {op: _dispatcher(op, storage, winners, rank_by, mode)
                   for op in {c.op for c in calls}}
    modules, rows = _resolve_calls(model, calls, dispatchers, mode)
    _warn_fallbacks(rows)
    return PatchHandle(model, list(modules.values()), rows, notes or _fusion_note(model),
                       capture, {"storage": storage, "winners": winners, "rank_by": rank_by},
                       _not_patched(model, set(modules), capture, ops), mode, layers)


def _replaceable_calls(capture: Capture, ops: list[str] | None) -> list[NormCall]:
    """The capture's module calls of the ops asked for (all ops when None); UserError if none."""
    calls = [c for c in capture.calls if c.source == "module" and (ops is None or c.op in ops)]
    if not calls:
        first = f" ({capture.skip_lines()[0]})" if capture.skipped else ""
        raise UserError(
            f"the capture records no replaceable norm module for the ops asked for{first}"
        )
    return calls


def _resolve_calls(model: nn.Module, calls: list[NormCall], dispatchers: dict[str, Dispatcher],
                   mode: str) -> tuple[dict[str, PatchedModule], list[PatchRow]]:
    """Each called module's patch (by path) with its table resolved for every captured key, and
    one report row per key."""
    modules: dict[str, PatchedModule] = {}
    rows: list[PatchRow] = []
    for call in calls:
        entry = modules.get(call.path)
        if entry is None:
            entry = modules[call.path] = PatchedModule(call.path, _find(model, call), call)
            entry.resolver = resolver(entry, dispatchers[call.op], mode)
        key = (torch.Size(call.shape), DTYPES[call.dtype])
        if key in entry.table:
            continue
        kernel, row = entry.resolver(_sample(model, call))
        entry.table[key] = None if kernel is None else entry.caller(kernel)
        rows.append(row)
    return modules, rows


def _warn_fallbacks(rows: list[PatchRow]) -> None:
    """UserError when no key got a kernel; else a warning (from patch()) for each key
    that keeps its module's own forward."""
    if all(row.match == "fallback" for row in rows):
        raise UserError(f"nothing to patch: {rows[0].path} at {rows[0].key}: {rows[0].why}")
    for row in rows:
        if row.match == "fallback":
            warnings.warn(f"fusionlab: {row.path} at {row.key} keeps its own forward: {row.why}",
                          stacklevel=3)


def _fusion_note(model: nn.Module) -> list[str]:
    """Without fuse=True: that the decoder layers' adds run apart from their norms."""
    layers = _decoder_layers(model)
    return [f"{len(layers)} decoder layer(s) ({layers[0]}, ...): {_FUSION_NOTE}"] if layers else []


def _not_patched(model: nn.Module, patched: set[str], capture: Capture,
                 ops: list[str] | None) -> list[SkippedNorm]:
    """Every module that looks like a norm and was not patched, with the reason."""
    from_capture = {s.path: s.why for s in capture.skipped}
    captured = {c.path: c.op for c in capture.calls if c.source == "module"}
    result = []
    for path, module in model.named_modules():
        if path in patched or not looks_like_norm(module):
            continue
        why = from_capture.get(path) or why_not_recognised(module)
        if not why and path in captured:
            why = f"op {captured[path]} left out (ops={','.join(ops or [])})"
        result.append(SkippedNorm(path, type(module).__name__, why or "not in the capture: "
                                  "capture this model again"))
    return result


def _patch_found_norms(model: nn.Module, storage: str | None,
                       winners: str | dict[str, str] | None, ops: list[str] | None, mode: str,
                       rank_by: str, layers: list[FusedLayer],
                       notes: list[str]) -> PatchHandle:
    """Patch without a capture: the norm modules found as capture finds them, their numerics
    probed on a random input in the weight's dtype, every key resolved on first use (and added to
    the report then)."""
    found = [(path, module, op) for path, module in model.named_modules()
             if (op := norm_op(module)) is not None and (ops is None or op in ops)]
    if not found:
        asked = f" for {', '.join(ops)}" if ops else ""
        raise UserError(f"{type(model).__name__} has no norm module fusionlab can replace{asked}")
    dispatchers = {op: _dispatcher(op, storage, winners, rank_by, mode) for _, _, op in found}
    modules = []
    for path, module, op in found:
        entry = PatchedModule(path, module, _probed_call(path, module, op))
        entry.resolver = resolver(entry, dispatchers[op], mode)
        modules.append(entry)
    device = modules[0].module.weight.device.type
    empty = Capture(type(model).__name__, device, torch.get_num_threads(), [], [])
    return PatchHandle(model, modules, [], notes or _fusion_note(model), empty,
                       {"storage": storage, "winners": winners, "rank_by": rank_by},
                       _not_patched(model, {m.path for m in modules}, empty, ops), mode, layers)


def _probed_call(path: str, module: nn.Module, op: str) -> NormCall:
    """The module's eps and numerics, probed on a random input in its weight's dtype."""
    weight = module.weight
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn((2, weight.shape[0]), generator=generator)
    sample = sample.to(dtype=weight.dtype, device=weight.device)
    info = inspect_norm(module, sample)
    return NormCall(path, type(module).__name__, "module", op, "", tuple(sample.shape),
                    dtype_name(weight.dtype), weight.device.type, info.eps, info.casting,
                    info.offset, 0)


def _dispatcher(op: str, storage: str | None, winners: str | dict[str, str] | None,
                rank_by: str, mode: str = "inference") -> Dispatcher:
    """The op's dispatcher; in training mode a key's forward+backward winner comes first."""
    training = mode == "training"
    if isinstance(winners, dict):
        if op not in winners:
            raise UserError(f"no winners file given for {op}: pass winners={{'{op}': FILE}}")
        return Dispatcher(op, winners=winners[op], rank_by=rank_by, training=training)
    if winners is not None:
        return Dispatcher(op, winners=winners, rank_by=rank_by, training=training)
    return Dispatcher(op, storage or DEFAULT_STORAGE, rank_by=rank_by, training=training)


def _find(model: nn.Module, call: NormCall) -> nn.Module:
    try:
        module = model.get_submodule(call.path)
    except AttributeError:
        module = None
    if module is None or type(module).__name__ != call.module_class:
        raise UserError(
            f"the capture names {call.path or 'the root'} ({call.module_class}), which this model "
            "does not have: capture this model first"
        )
    return module


def _sample(model: nn.Module, call: NormCall) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(call.shape, generator=generator)
    return x.to(dtype=DTYPES[call.dtype], device=call.device)


def resolver(entry: PatchedModule, dispatcher: Dispatcher,
             mode: str) -> Callable[[torch.Tensor], tuple[Kernel | None, PatchRow]]:
    """Choose, build and check the kernel for one key of one module: the winner, else the next
    fastest variant of the cell that computes the module's numerics and rounds like it."""

    def resolve(x: torch.Tensor) -> tuple[Kernel | None, PatchRow]:
        dtype = next(name for name, value in DTYPES.items() if value == x.dtype)
        key = f"{format_shape(tuple(x.shape))} {dtype}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason goes into the row and one warning
            choice = dispatcher.choose(tuple(x.shape), x.dtype, x.device.type)

        def keep(why: str, match: str = "fallback") -> tuple[None, PatchRow]:
            return None, PatchRow(entry.path, entry.op, key, "(module's own)", match, why)

        if choice.match == "fallback":
            return keep(choice.reason or "no winner for this key")
        check_numerics_exist(entry, dtype)
        if mode == "training" and not get_variant(entry.op, choice.variant).autograd:
            raise UserError(
                f"patch(mode='training'): {entry.op} winner {choice.variant} for {entry.path} "
                "has no backward; patch for inference, or sweep variants that have one"
            )
        refused: list[str] = []
        for name, params in ((choice.variant, choice.params), *choice.alternatives):
            kernel, problem = _candidate(entry, name, params, x, mode)
            if kernel is not None:
                why = "; ".join(refused + ([choice.reason] if choice.reason else []))
                numerics = "bit-exact" if must_be_exact(x.dtype) else "within tolerance"
                return kernel, _row(entry, key, choice, name, params, why, numerics)
            refused.append(f"{name}{params_text(params)} {problem}")
        return keep("; ".join(refused))

    return resolve


def _candidate(entry: PatchedModule, name: str, params: dict[str, Any], x: torch.Tensor,
               mode: str) -> tuple[Kernel | None, str]:
    """The variant's kernel for this module if it can replace it on x, else why it cannot."""
    variants = variants_of(entry.op)
    dtype = next(n for n, value in DTYPES.items() if value == x.dtype)
    if name not in variants:
        return None, "is not registered in this process"
    variant = variants[name]
    if not supports(variant, dtype, entry.casting, entry.offset):
        return None, f"does not compute {numerics_text(entry)} in {dtype}"
    if mode == "training" and not variant.autograd:
        return None, "has no backward"
    built = (name, tuple(sorted(params.items())), x.device.type)
    kernel = entry.kernels.get(built)
    if kernel is None:
        kernel = build_kernel(variant, x.device.type, params, entry.casting, entry.offset)
        entry.kernels[built] = kernel
    problem = _disagreement(entry, kernel, x)
    if not problem and must_be_exact(x.dtype):
        probe = (*built, x.dtype)
        if probe not in entry.probed:
            entry.probed[probe] = _disagreement(entry, kernel, probe_rows(x))
        problem = entry.probed[probe]
    return (None, f"disagrees with the module: {problem}") if problem else (kernel, "")


def _row(entry: PatchedModule, key: str, choice: Choice, name: str, params: dict[str, Any],
         why: str, numerics: str) -> PatchRow:
    return PatchRow(entry.path, entry.op, key, name + params_text(params), choice.match, why,
                    numerics, choice.pass_name)


def _disagreement(entry: PatchedModule, kernel: Kernel, x: torch.Tensor) -> str:
    """Why the kernel's output is not the module's own ("" if it is): equal bit for bit in 16-bit
    dtypes, else within the op's tolerance."""
    tolerance = get_op(entry.op).tolerance(x.dtype)
    with torch.no_grad():
        expected = entry.original(x)
        try:
            got = get_op(entry.op).as_outputs(kernel(*entry.args(x)))[0]
        except Exception as error:  # variant code may raise anything: it then does not patch
            return f"{type(error).__name__}: {error}"
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return "wrong output shape"
    if got.dtype != expected.dtype:
        return f"returns {got.dtype}, the module {expected.dtype}"
    if must_be_exact(x.dtype):
        differ = int((got != expected).sum().item())
        return f"{differ} of {got.numel()} elements round otherwise" if differ else ""
    if not torch.allclose(got, expected, atol=tolerance.atol, rtol=tolerance.rtol):
        worst = (got.float() - expected.float()).abs().max().item()
        return f"max difference {worst:.3g} beyond atol {tolerance.atol:g} rtol {tolerance.rtol:g}"
    return ""


def _decoder_layers(model: nn.Module) -> list[str]:
    return [path for path, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]

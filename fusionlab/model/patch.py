"""Patch a model's captured norm modules with the winners: each module's forward becomes a table
lookup (shape, dtype) -> chosen kernel, resolved and checked against the module's own output once
per key. Nothing is changed until every module is resolved, so a failed patch changes nothing.

In 16-bit dtypes a kernel must reproduce the module bit for bit (on the input and on a probe of
many rows); one that does not gives way to the next fastest variant of the cell that does. Under
torch.compile the forward is one opaque op call (fusionlab/model/patched_op.py)."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tabulate import tabulate
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model import patched_op
from fusionlab.model.capture import Capture, NormCall
from fusionlab.model.norms import (
    SkippedNorm,
    inspect_norm,
    looks_like_norm,
    norm_op,
    why_not_recognised,
)
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.registry import Kernel, Variant, get_op, get_variant, variants_of
from fusionlab.runtime import Choice, Dispatcher
from fusionlab.search.storage import DEFAULT_STORAGE
from fusionlab.shapes import DTYPES, dtype_name, format_shape

if TYPE_CHECKING:
    from fusionlab.model.fuse import FusedLayer

MODES = ("inference", "training")
_FUSION_NOTE = (
    "not fused: each residual add runs apart from the norm after it; patch(..., fuse=True) runs "
    "the add after the attention and the norm after it as one add_rmsnorm / add_layernorm call"
)


@dataclass(frozen=True)
class PatchRow:
    """What one module got at one key, and why."""

    path: str
    op: str
    key: str
    variant: str  # "(module's own)" when it keeps its forward
    match: str  # exact | nearest | fallback
    why: str = ""
    numerics: str = ""  # how the kernel's output compares with the module's own
    pass_name: str = ""  # the sweep pass whose cell chose the variant ("" when none did)


def supports(variant: Variant, dtype: str, casting: str, offset: float) -> bool:
    """Whether a variant computes a module's numerics: it declares them, or the module is float32
    without an offset (every casting mode then rounds alike)."""
    return variant.supports(Numerics(casting, offset)) or (dtype == "float32" and not offset)


def build_kernel(variant: Variant, device_type: str, params: dict[str, Any], casting: str,
                 offset: float) -> Kernel:
    """The variant's kernel, told the module's numerics when it computes them; else (float32, no
    offset: see `supports`) the kernel the sweep timed."""
    numerics = Numerics(casting, offset)
    if numerics == DEFAULT or not variant.supports(numerics):
        return variant.factory(device_type, **params)
    return variant.factory(device_type, numerics=numerics, **params)


class PatchedModule:
    """One captured module: how to call an op kernel with its parameters, and its dispatch table."""

    def __init__(self, path: str, module: nn.Module, call: NormCall,
                 original: Callable[..., object] | None = None) -> None:
        self.path, self.module, self.op = path, module, call.op
        self.eps, self.casting, self.offset = call.eps, call.casting, call.offset
        self.original = original or module.forward
        # (shape, dtype) -> the bound kernel call, or None to keep the module's own forward
        self.table: dict[tuple[torch.Size, torch.dtype], Callable[..., object] | None] = {}
        names = get_op(call.op).inputs
        known = {"x", "weight", "bias", "eps"}
        if set(names) - known:
            raise UserError(f"{path}: op {call.op} takes {names}; only norms of x can be patched")
        self.names = names
        self.resolver: Callable[[torch.Tensor], tuple[Kernel | None, PatchRow]] | None = None
        self.late_rows: list[PatchRow] = []  # keys first seen after patching
        # (variant, params, numerics, device type) -> the built kernel
        self.kernels: dict[tuple[object, ...], Kernel] = {}
        # (variant, params, dtype) -> "" when it rounds like the module on the probe, else why not
        self.probed: dict[tuple[object, ...], str] = {}
        self.slot = patched_op.register(self)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The patched call: the key's kernel, resolved and checked on first use of the key."""
        call = self.table.get((x.shape, x.dtype), False)
        if call is False:  # a key not seen at patch time: resolve and check it once
            call = _resolve_late(self, x)
        if call is None:
            return self.original(x)
        return call(x)

    def args(self, x: torch.Tensor) -> tuple[object, ...]:
        values = {"x": x, "weight": self.module.weight, "bias": self.bias(), "eps": self.eps}
        return tuple(values[name] for name in self.names)

    def bias(self) -> torch.Tensor:
        """The module's bias, or zeros for a norm without one (adding zero changes no bit)."""
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else torch.zeros_like(self.module.weight)

    def caller(self, kernel: Kernel) -> Callable[[torch.Tensor], object]:
        """kernel(x, parameters..., eps) with the parameters bound: the per-call path."""
        weight, eps = self.module.weight, self.eps
        if self.names == ("x", "weight", "eps"):
            return lambda x: kernel(x, weight, eps)
        if self.names == ("x", "weight", "bias", "eps"):
            bias = self.bias()
            return lambda x: kernel(x, weight, bias, eps)
        return lambda x: kernel(*self.args(x))


class PatchHandle:
    """The patched model: `.report()`, `.undo()`, `.benchmark(...)`."""

    def __init__(self, model: nn.Module, modules: list[PatchedModule], rows: list[PatchRow],
                 fused: list[str], capture: Capture, winners_source: dict[str, Any],
                 skipped: list[SkippedNorm] | None = None, mode: str = "inference",
                 layers: list[FusedLayer] | None = None) -> None:
        self.model, self.modules, self.rows, self.fused = model, modules, rows, fused
        self.layers = layers or []  # decoder layers whose add + norm run fused (fuse=True)
        self.mode = mode  # "training": every chosen kernel has a backward
        self.skipped = skipped or []  # modules that look like norms and keep their own forward
        self.capture, self.winners_source = capture, winners_source
        self._saved = {m.path: m.module.__dict__.get("forward") for m in modules}
        self._forwards = {m.path: _patched_forward(m) for m in modules}
        self.redo()

    def report(self) -> str:
        """Module (or fused layer), key, chosen variant, exact/nearest/fallback, numerics and
        why (keys resolved after patching included); then the modules that look like norms and
        were not patched, with why; then which layers' adds were fused and which not."""
        rows = self.all_rows()
        headers = ["module", "op", "key", "variant", "match", "numerics", "why"]
        cells = [[r.path, r.op, r.key, r.variant, r.match, r.numerics, r.why] for r in rows]
        if self.mode == "training":  # which pass's sweep chose each module's kernel
            headers.insert(4, "from pass")
            for cell, row in zip(cells, rows, strict=True):
                cell.insert(4, row.pass_name or "-")
        table = tabulate(cells, headers=headers, tablefmt="simple")
        skipped = [f"not patched: {s.path or 'the root'} ({s.module_class}): {s.why}"
                   for s in self.skipped]
        return "\n".join([table, *skipped, *self.fused])

    def all_rows(self) -> list[PatchRow]:
        """The keys resolved at patch time, then those each module (and fused layer) resolved
        on first use."""
        return (self.rows + [r for m in self.modules for r in m.late_rows]
                + [r for layer in self.layers for r in layer.add_norm.rows])

    def fused_calls(self) -> int:
        """How many fused add + norm kernel calls have run (a layer's own add and norm, where it
        keeps them, not counted)."""
        return sum(layer.add_norm.calls for layer in self.layers)

    def undo(self) -> None:
        """Give every module and layer its own forward back."""
        for layer in self.layers:
            layer.undo()
        for entry in self.modules:
            saved = self._saved[entry.path]
            if saved is None:
                entry.module.__dict__.pop("forward", None)
            else:
                entry.module.forward = saved

    def redo(self) -> None:
        """Patch again after `undo` (the choices stay resolved)."""
        for entry in self.modules:
            entry.module.forward = self._forwards[entry.path]
        for layer in self.layers:
            layer.patch()

    def benchmark(self, steps: list[Any], runs: int = 30) -> Any:
        """Time the model patched and unpatched alternately (see fusionlab.model.bench)."""
        from fusionlab.model.bench import benchmark

        return benchmark(self, steps, runs)

    def benchmark_training(self, tokens: list[int], runs: int = 20, seed: int = 0) -> Any:
        """Time training steps patched against an unpatched copy, compare their gradients and
        peak memory (see fusionlab.model.train_bench)."""
        from fusionlab.model.train_bench import benchmark_training

        return benchmark_training(self, tokens, runs, seed)


def _patched_forward(entry: PatchedModule) -> Callable[..., object]:
    """Eager: the table lookup. Traced by torch.compile: one opaque op whose real kernel does the
    lookup at run time, so no shape is specialised on and nothing of the resolution is traced;
    where gradients are wanted the lookup itself is traced, as in eager."""
    run, slot = entry.run, entry.slot
    parameters = list(entry.module.parameters(recurse=False))
    patched_norm = torch.ops.fusionlab.patched_norm

    def forward(self: nn.Module, x: torch.Tensor) -> object:
        if torch.compiler.is_compiling() and not _wants_grad(x, parameters):
            return patched_norm(x, slot)
        return run(x)

    return types.MethodType(forward, entry.module)


def _wants_grad(x: torch.Tensor, parameters: list[nn.Parameter]) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in parameters)


def _resolve_late(entry: PatchedModule, x: torch.Tensor) -> Callable[..., object] | None:
    assert entry.resolver is not None
    kernel, row = entry.resolver(x)
    if row.match == "fallback":
        warnings.warn(f"fusionlab: {row.path} at {row.key} keeps its own forward: {row.why}",
                      stacklevel=3)
    call = None if kernel is None else entry.caller(kernel)
    entry.table[(x.shape, x.dtype)] = call
    entry.late_rows.append(row)
    return call


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
    from fusionlab.model.fuse import fuse_layers

    return fuse_layers(model, lambda op: _dispatcher(op, storage, winners, rank_by, mode), mode)


def _patch_norms(model: nn.Module, capture: Capture | str | None, storage: str | None,
                 winners: str | dict[str, str] | None, ops: list[str] | None, mode: str,
                 rank_by: str, fuse: bool) -> PatchHandle:
    layers, notes = _fused_layers(model, storage, winners, mode, rank_by) if fuse else ([], [])
    if capture is None:
        return _patch_found_norms(model, storage, winners, ops, mode, rank_by, layers, notes)
    if isinstance(capture, str):
        capture = Capture.load(capture)
    calls = [c for c in capture.calls if c.source == "module" and (ops is None or c.op in ops)]
    if not calls:
        first = f" ({capture.skip_lines()[0]})" if capture.skipped else ""
        raise UserError(
            f"the capture records no replaceable norm module for the ops asked for{first}"
        )
    dispatchers = {op: _dispatcher(op, storage, winners, rank_by, mode)
                   for op in {c.op for c in calls}}
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
        sample = _sample(model, call)
        kernel, row = entry.resolver(sample)
        entry.table[key] = None if kernel is None else entry.caller(kernel)
        rows.append(row)
    if all(row.match == "fallback" for row in rows):
        raise UserError(f"nothing to patch: {rows[0].path} at {rows[0].key}: {rows[0].why}")
    for row in rows:
        if row.match == "fallback":
            warnings.warn(f"fusionlab: {row.path} at {row.key} keeps its own forward: {row.why}",
                          stacklevel=2)
    return PatchHandle(model, list(modules.values()), rows, notes or _fusion_note(model),
                       capture, {"storage": storage, "winners": winners, "rank_by": rank_by},
                       _not_patched(model, set(modules), capture, ops), mode, layers)


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
        _check_numerics_exist(entry, dtype)
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
                numerics = "bit-exact" if _must_be_exact(x.dtype) else "within tolerance"
                return kernel, _row(entry, key, choice, name, params, why, numerics)
            refused.append(f"{name}{_params_text(params)} {problem}")
        return keep("; ".join(refused))

    return resolve


def _check_numerics_exist(entry: PatchedModule, dtype: str) -> None:
    """Refuse a module whose numerics no variant of its op computes, in one line."""
    if not any(supports(v, dtype, entry.casting, entry.offset)
               for v in variants_of(entry.op).values()):
        raise UserError(
            f"{entry.path}: no {entry.op} variant computes its numerics ({_numerics_text(entry)}, "
            f"{dtype}); leave {entry.op} out (ops=...) or add a variant that does"
        )


def _numerics_text(entry: PatchedModule) -> str:
    offset = f", weight offset {entry.offset:g}" if entry.offset else ""
    return f"{entry.casting} casting{offset}"


def _candidate(entry: PatchedModule, name: str, params: dict[str, Any], x: torch.Tensor,
               mode: str) -> tuple[Kernel | None, str]:
    """The variant's kernel for this module if it can replace it on x, else why it cannot."""
    variants = variants_of(entry.op)
    dtype = next(n for n, value in DTYPES.items() if value == x.dtype)
    if name not in variants:
        return None, "is not registered in this process"
    variant = variants[name]
    if not supports(variant, dtype, entry.casting, entry.offset):
        return None, f"does not compute {_numerics_text(entry)} in {dtype}"
    if mode == "training" and not variant.autograd:
        return None, "has no backward"
    built = (name, tuple(sorted(params.items())), x.device.type)
    kernel = entry.kernels.get(built)
    if kernel is None:
        kernel = build_kernel(variant, x.device.type, params, entry.casting, entry.offset)
        entry.kernels[built] = kernel
    problem = _disagreement(entry, kernel, x)
    if not problem and _must_be_exact(x.dtype):
        probe = (*built, x.dtype)
        if probe not in entry.probed:
            entry.probed[probe] = _disagreement(entry, kernel, _probe(x))
        problem = entry.probed[probe]
    return (None, f"disagrees with the module: {problem}") if problem else (kernel, "")


def _must_be_exact(dtype: torch.dtype) -> bool:
    """16-bit outputs must equal the module's bit for bit: a one-step difference in a norm's
    output compounds through the layers (float32 keeps the op's tolerance)."""
    return dtype in (torch.float16, torch.bfloat16)


_PROBE_ELEMENTS = 1 << 20


def _probe(x: torch.Tensor) -> torch.Tensor:
    """About a million elements like a model's activations (row scales spread over orders of
    magnitude, a few outlier channels): a kernel that sums in another order than the module
    rounds about one element in 1e5 otherwise, so it shows here."""
    generator = torch.Generator().manual_seed(0)
    hidden = x.shape[-1]
    count = max(_PROBE_ELEMENTS // max(hidden, 1), 1)
    rows = torch.randn(count, hidden, generator=generator)
    rows *= torch.exp(2 * torch.randn(count, 1, generator=generator))
    outliers = torch.randint(0, hidden, (max(hidden // 64, 1),), generator=generator)
    rows[:, outliers] *= 20
    return rows.to(dtype=x.dtype, device=x.device)


def _params_text(params: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"({text})" if text else ""


def _row(entry: PatchedModule, key: str, choice: Choice, name: str, params: dict[str, Any],
         why: str, numerics: str) -> PatchRow:
    return PatchRow(entry.path, entry.op, key, name + _params_text(params), choice.match, why,
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
    if _must_be_exact(x.dtype):
        differ = int((got != expected).sum().item())
        return f"{differ} of {got.numel()} elements round otherwise" if differ else ""
    if not torch.allclose(got, expected, atol=tolerance.atol, rtol=tolerance.rtol):
        worst = (got.float() - expected.float()).abs().max().item()
        return f"max difference {worst:.3g} beyond atol {tolerance.atol:g} rtol {tolerance.rtol:g}"
    return ""


def _decoder_layers(model: nn.Module) -> list[str]:
    return [path for path, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]

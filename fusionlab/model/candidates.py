"""Fusion candidates: the memory-bound ops around each norm module in the traced graph of a step
(a residual add feeding it, and whether the sum is reused as the residual stream is; dtype casts;
a scale after it; its output feeding attention as query or key, the per-head QK-norm), joined
with the captured norm calls, so every candidate has a key, a count per step and a time."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from fusionlab.model.graph_trace import TracedStep, TraceFailed, slot_of, trace_step
from fusionlab.model.models import Step
from fusionlab.registry import op_names
from fusionlab.shapes import format_shape

if TYPE_CHECKING:
    from fusionlab.model.norm_call import NormCall

_ADDS = {"add", "iadd", "add_", "__add__", "__iadd__"}
_MULS = {"mul", "imul", "mul_", "__mul__", "__imul__"}
_CASTS = {"to", "float", "half", "bfloat16", "double", "type"}
_ATTENTION = {"scaled_dot_product_attention", "matmul", "bmm"}
_WEIGHTED = {"linear", "addmm", "mm", "conv1d", "conv2d", "embedding", "baddbmm"}
_SEARCH_LIMIT = 64  # nodes looked at from a norm's output to find the attention it feeds


@dataclass(frozen=True)
class Chain:
    """The ops around one norm module in the traced graph."""

    add: bool = False  # a residual add of two same-shape tensors feeds the norm
    sum_reused: bool = False  # the sum also feeds later ops (the residual stream)
    casts_before: tuple[str, ...] = ()  # dtypes cast to between the add (if any) and the norm
    casts_after: tuple[str, ...] = ()  # dtypes cast to right after the norm
    scale_after: bool = False  # the output (after casts) is multiplied by a scalar
    attention: str = ""  # "query" or "key" when the output feeds attention: a QK-norm


@dataclass(frozen=True)
class FusionCandidate:
    """A norm call with memory-bound ops around it that one fused kernel could take in."""

    path: str  # the norm module's path
    step: str
    kind: str  # "add+norm", "qk-norm" or "norm" (casts or a scale only)
    op: str  # the op that computes the fused chain: add_rmsnorm, add_layernorm, or the norm's
    norm: str  # the norm op alone (rmsnorm or layernorm)
    shape: tuple[int, ...]
    dtype: str
    calls: int  # per step
    call_us: float  # the norm's own call, timed on its own by capture
    sum_reused: bool = False
    casts_before: tuple[str, ...] = ()
    casts_after: tuple[str, ...] = ()
    scale_after: bool = False
    attention: str = ""
    offset: float = 0.0  # the norm's weight offset (Gemma's 1 + weight)

    @property
    def key(self) -> str:
        return f"{format_shape(self.shape)} {self.dtype}"

    def pattern(self) -> str:
        """The chain as ops in order, e.g. `add > to(float32) > rmsnorm > scale`."""
        parts = ["add" + (" (sum reused)" if self.sum_reused else "")] if self.kind == "add+norm" \
            else []
        parts += [f"to({dtype})" for dtype in self.casts_before]
        parts.append(self.norm + (f" ({self.offset:g} + w)" if self.offset else ""))
        parts += [f"to({dtype})" for dtype in self.casts_after]
        parts += ["scale"] if self.scale_after else []
        parts += [f"attention {self.attention}"] if self.attention else []
        return " > ".join(parts)


@dataclass
class Search:
    """What tracing a step found: the candidates, the step traced ("" when none was), why the
    trace failed ("" when it did not), and the norms whose chain is unknown."""

    candidates: list[FusionCandidate]
    traced: str = ""
    problem: str = ""
    untraced: list[str] = field(default_factory=list)


def find_candidates(model: nn.Module, step: Step, calls: list[NormCall]) -> Search:
    """Trace `step` and read the chain around each captured norm module. A norm's chain is
    unknown when the trace fails, when the graph does not call it, or when it is a function
    call rather than a module."""
    paths = list(dict.fromkeys(c.path for c in calls if c.source == "module"))
    functional = list(dict.fromkeys(f"{c.path or 'the root'} (a function call)"
                                    for c in calls if c.source == "function"))
    if not paths:
        problem = "every captured norm is a function call, not a module" if functional else ""
        return Search([], "", problem, functional)
    try:
        traced = trace_step(model, step, paths)
    except TraceFailed as error:
        return Search([], "", f"dynamo could not trace the {step.name} step whole ({error})",
                      paths + functional)
    chains = chains_of(traced)
    return Search(candidates_from(calls, chains), step.name, "",
                  [p for p in paths if p not in chains] + functional)


def chains_of(traced: TracedStep) -> dict[str, Chain]:
    """The chain around every marked norm in the traced graph, by module path."""
    chains = {}
    for node in traced.graph.graph.nodes:
        slot = slot_of(node)
        if slot is not None and slot in traced.paths:
            chains[traced.paths[slot]] = _chain(node)
    return chains


def candidates_from(calls: list[NormCall], chains: dict[str, Chain]) -> list[FusionCandidate]:
    """A candidate for each captured module norm call whose chain holds something to fuse."""
    found = []
    for call in calls:
        chain = chains.get(call.path) if call.source == "module" else None
        if chain is None:
            continue
        kind = ("add+norm" if chain.add else "qk-norm" if chain.attention
                else "norm" if chain.casts_before or chain.casts_after or chain.scale_after
                else "")
        if not kind:
            continue
        fused = f"add_{call.op}" if chain.add and f"add_{call.op}" in op_names() else call.op
        found.append(FusionCandidate(
            call.path, call.step, kind, fused, call.op, call.shape, call.dtype, call.calls,
            call.call_us, chain.sum_reused, chain.casts_before, chain.casts_after,
            chain.scale_after, chain.attention, call.offset,
        ))
    return found


def _chain(norm: fx.Node) -> Chain:
    source = norm.args[0]
    casts_before: list[str] = []
    between: list[fx.Node] = []  # the sum on its way to the norm (casts, eval-mode dropout)
    while isinstance(source, fx.Node) and _passes_through(source):
        if _is_cast(source):
            casts_before.insert(0, _dtype_of(source))
        between.append(source)
        source = source.args[0]
    add = isinstance(source, fx.Node) and _is_residual_add(source)
    output, casts_after = norm, []
    while len(output.users) == 1 and _passes_through(next(iter(output.users))):
        output = next(iter(output.users))
        if _is_cast(output):
            casts_after.append(_dtype_of(output))
    return Chain(
        add=add,
        sum_reused=add and any(len(node.users) > 1 for node in [source, *between]),
        casts_before=tuple(casts_before),
        casts_after=tuple(casts_after),
        scale_after=len(output.users) == 1 and _is_scale(next(iter(output.users)), output),
        attention=_attention_input(norm),
    )


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return ""


def _value(node: object) -> torch.Tensor | None:
    """The example tensor dynamo recorded for a node (None for a non-tensor)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _dtype_of(node: fx.Node) -> str:
    value = _value(node)
    return str(value.dtype).removeprefix("torch.") if value is not None else "?"


def _passes_through(node: fx.Node) -> bool:
    """A cast, or a dropout that does nothing (eval mode): the value flows on unchanged in
    layout."""
    if _is_cast(node) or (_name(node) == "to" and _same_tensor(node)):
        return True
    if _name(node) == "dropout":
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return training is False
    return False


def _is_cast(node: fx.Node) -> bool:
    """A dtype conversion of one tensor to another dtype, same shape."""
    if _name(node) not in _CASTS or not node.args:
        return False
    before, after = _value(node.args[0]), _value(node)
    return (before is not None and after is not None and before.shape == after.shape
            and before.dtype != after.dtype)


def _same_tensor(node: fx.Node) -> bool:
    before, after = _value(node.args[0]) if node.args else None, _value(node)
    return (before is not None and after is not None and before.shape == after.shape
            and before.dtype == after.dtype)


def _is_residual_add(node: fx.Node) -> bool:
    """An add of two tensors of the output's shape (no broadcast): a residual add."""
    if _name(node) not in _ADDS or len(node.args) < 2:
        return False
    out = _value(node)
    values = [_value(arg) for arg in node.args[:2]]
    return out is not None and all(v is not None and v.shape == out.shape for v in values)


def _is_scale(node: fx.Node, source: fx.Node) -> bool:
    """A multiply of `source` by a number or a one-element tensor."""
    if _name(node) not in _MULS or len(node.args) < 2:
        return False
    other = node.args[1] if node.args[0] is source else node.args[0]
    if isinstance(other, (int, float)):
        return True
    value = _value(other)
    return value is not None and value.numel() == 1


def _attention_input(norm: fx.Node) -> str:
    """"query" or "key" when the norm's output reaches attention's first or second input through
    ops without weights (views, rotary embedding, casts), else ""."""
    frontier, seen = [norm], {norm}
    while frontier and len(seen) < _SEARCH_LIMIT:
        node = frontier.pop(0)
        for user in node.users:
            name = _name(user)
            if name in _ATTENTION or user.target is operator.matmul:
                query = user.args[0] if user.args else user.kwargs.get("query")
                key = user.args[1] if len(user.args) > 1 else user.kwargs.get("key")
                if node is query or node is key:
                    return "query" if node is query else "key"
                continue
            if name in _WEIGHTED or slot_of(user) is not None or user in seen:
                continue
            seen.add(user)
            frontier.append(user)
    return ""

"""Trace one model step with dynamo into FX graphs, each norm module standing in the graph as one
opaque op call `fusionlab::traced_norm(x, slot)`: its input and output are then single nodes,
whatever the module computes inside, and the slot names the module. The recording backend keeps
the graphs and runs them as they are (no compiler)."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusionlab.model.models import Step

# slot -> the module's own forward, while a trace runs
_FORWARDS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}


@torch.library.custom_op("fusionlab::traced_norm", mutates_args=())
def traced_norm(x: torch.Tensor, slot: int) -> torch.Tensor:
    """The norm module in `slot` applied to x (its own forward)."""
    out = _FORWARDS[slot](x)
    return out.clone() if out.data_ptr() == x.data_ptr() else out


@traced_norm.register_fake
def _traced_norm_fake(x: torch.Tensor, slot: int) -> torch.Tensor:
    with unset_fake_temporarily(), torch.no_grad():
        row = torch.zeros(1, x.shape[-1], dtype=x.dtype, device=x.device)
        dtype = _FORWARDS[slot](row).dtype
    return x.new_empty(x.shape, dtype=dtype)


class TraceFailed(Exception):
    """Dynamo could not trace the step into one graph (the message says why, in one line)."""


@dataclass
class TracedStep:
    """The graph of one step and the module path each norm slot stands for."""

    step: str
    graph: fx.GraphModule
    paths: dict[int, str]


def slot_of(node: fx.Node) -> int | None:
    """The slot of a node that calls a traced norm, else None."""
    if node.op == "call_function" and "traced_norm" in str(node.target):
        slot = node.args[1]
        return slot if isinstance(slot, int) else None
    return None


def trace_step(model: nn.Module, step: Step, paths: list[str]) -> TracedStep:
    """The step's whole graph (fullgraph: a graph break fails), the norm modules at `paths`
    marked. Every module's forward is restored and dynamo's cache of the step dropped after."""
    modules = dict(model.named_modules())
    saved = {path: modules[path].__dict__.get("forward") for path in paths}
    graphs: list[fx.GraphModule] = []

    def record(graph: fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., object]:
        graphs.append(graph)
        return graph.forward

    try:
        for slot, path in enumerate(paths):
            _FORWARDS[slot] = modules[path].forward
            modules[path].forward = types.MethodType(_marked(slot), modules[path])
        compiled = torch.compile(step.run, backend=record, fullgraph=True, dynamic=False)
        with torch.no_grad():
            compiled()
    except Exception as error:  # dynamo reports what it cannot trace as many exception types
        raise TraceFailed(_first_line(error)) from None
    finally:
        for path, forward in saved.items():
            if forward is None:
                modules[path].__dict__.pop("forward", None)
            else:
                modules[path].forward = forward
        _FORWARDS.clear()
        torch._dynamo.eval_frame.remove_from_cache(step.run)
    if len(graphs) != 1:
        raise TraceFailed(f"dynamo made {len(graphs)} graphs of it, not one")
    return TracedStep(step.name, graphs[0], dict(enumerate(paths)))


def _marked(slot: int) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def forward(_: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fusionlab.traced_norm(x, slot)

    return forward


def _first_line(error: Exception, limit: int = 160) -> str:
    """The error's type and the first line of its message, cut at a word within `limit`."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

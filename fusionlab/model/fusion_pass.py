"""`torch.compile(model, backend=fusionlab.backend(storage=...))`: a dynamo backend that rewrites
each residual add feeding a norm into one fused add_rmsnorm / add_layernorm call, then hands the
graph to inductor.

The norm is found by the module it was traced from (each node's `nn_module_stack`), so the chain
dynamo records for it (casts, pow, mean, rsqrt, multiplies; or `F.layer_norm`/`torch.rms_norm`)
need not be matched op by op: the nodes of one norm module with a single activation input, the
norm's parameters as graph inputs and a single output form the norm; when that input is an add
of two tensors of its shape, the add and the norm become `fusionlab::patched_add_norm(a, b,
slot)` (functional: it returns (y, a + b), and the sum replaces the add's other uses, as the
residual stream reuses it). Its real kernel dispatches per key at run time and checks each
kernel against the norm's own nodes (fusionlab/model/fused_add_norm.py), so the pass works
across decoder-layer boundaries: the add ending one layer and the next layer's first norm (or
the final norm) fuse as well."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fusionlab.errors import UserError
from fusionlab.model.fused_add_norm import FUSED_OPS, FusedAddNorm
from fusionlab.model.norms import NormInfo, numerics_of, op_of_class
from fusionlab.runtime import Dispatcher

_ADDS = (operator.add, torch.add, torch.Tensor.add)


@dataclass
class _Norm:
    """The nodes one norm module was traced into."""

    path: str
    op: str
    nodes: list[fx.Node] = field(default_factory=list)


class FusionBackend:
    """The backend: call it as torch.compile does; `fused` holds every add + norm it rewrote,
    `notes` every norm after an add it left alone, with why."""

    def __init__(self, dispatcher_for: Callable[[str], Dispatcher | None],
                 compile_graph: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]) -> None:
        self.dispatcher_for, self.compile_graph = dispatcher_for, compile_graph
        self.dispatchers: dict[str, Dispatcher | None] = {}
        self.fused: list[FusedAddNorm] = []
        self.notes: list[str] = []
        self.rewrites: list[int] = []  # fused ops put into each graph compiled

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        rewrite(gm, example_inputs, self)
        self.rewrites.append(fused_ops_in(gm))
        return self.compile_graph(gm, example_inputs)

    def dispatcher(self, op: str) -> Dispatcher | None:
        """The op's dispatcher, or None when there are no results of it."""
        if op not in self.dispatchers:
            dispatcher = self.dispatcher_for(op)
            has = dispatcher is not None and dispatcher.has_results()
            self.dispatchers[op] = dispatcher if has else None
        return self.dispatchers[op]

    def fused_calls(self) -> int:
        """Fused kernel calls that ran (an add + norm left apart at a key not counted)."""
        return sum(entry.calls for entry in self.fused)

    def report(self) -> str:
        """One line per rewritten add + norm and its keys, then the notes."""
        lines = [f"fused: {entry.path} ({entry.op})" for entry in self.fused]
        for entry in self.fused:
            lines += [f"  {row.key}: {row.variant} [{row.match}] {row.numerics} {row.why}".rstrip()
                      for row in entry.rows]
        return "\n".join(lines + self.notes)


def backend(storage: str | None = None, winners: dict[str, str] | None = None,
            rank_by: str = "cold", inductor: bool = True) -> FusionBackend:
    """A torch.compile backend that fuses each residual add + norm with the winners in `storage`
    (or `winners`: {op: winners file}), then compiles with inductor (`inductor=False`: runs the
    rewritten graph as it is). Refused in one line when there are no add_rmsnorm or add_layernorm
    results at all."""
    from fusionlab.model.patch import _dispatcher

    if winners is not None and not isinstance(winners, dict):
        raise UserError("fusionlab.backend: give winners as {op: file}, e.g. "
                        "winners={'add_rmsnorm': 'add_rmsnorm.json'}")

    def dispatcher_for(op: str) -> Dispatcher | None:
        if isinstance(winners, dict) and op not in winners:
            return None  # no winners file for this fused op: its adds stay apart
        return _dispatcher(op, storage, winners, rank_by)

    made = FusionBackend(dispatcher_for, _inductor if inductor else _as_is)
    ops = sorted(FUSED_OPS.values())
    if not any(made.dispatcher(op) is not None for op in ops):
        raise UserError(f"fusionlab.backend: no {' or '.join(ops)} results to fuse with; run "
                        "`fusionlab sweep add_rmsnorm --shapes ROWSxHIDDEN` at the model's shapes")
    return made


def fused_ops_in(gm: fx.GraphModule) -> int:
    """How many fused add + norm calls the graph holds."""
    op = torch.ops.fusionlab.patched_add_norm.default
    return sum(1 for node in gm.graph.nodes if node.target is op)


def _inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _as_is(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    return gm.forward


def rewrite(gm: fx.GraphModule, example_inputs: Sequence[Any], into: FusionBackend) -> int:
    """Rewrite each add feeding a norm in the graph into the fused op; returns how many."""
    values = _values(gm, example_inputs)
    count = 0
    for norm in _norms(gm.graph):
        why = _fuse(gm, norm, values, into)
        if why is None:
            count += 1
        elif why:
            into.notes.append(f"not fused: {norm.path}: {why}")
    if count:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return count


def _values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    """Each placeholder's real example input, and each get_attr's tensor."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values: dict[fx.Node, Any] = dict(zip(placeholders, example_inputs, strict=False))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            values[node] = operator.attrgetter(str(node.target))(gm)
    return values


def _norms(graph: fx.Graph) -> list[_Norm]:
    """The graph's nodes grouped by the norm module they were traced from (innermost)."""
    found: dict[str, _Norm] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op not in ("call_function", "call_method", "call_module") or not stack:
            continue
        path, cls = list(stack.values())[-1]
        op = op_of_class(cls) if isinstance(cls, type) else None
        if op is not None:
            found.setdefault(path, _Norm(_clean(path), op)).nodes.append(node)
    return list(found.values())


def _clean(path: str) -> str:
    """`L['self'].model.layers[0].norm` -> `model.layers.0.norm`."""
    for prefix in ("L['self'].", "L['self']"):
        path = path.removeprefix(prefix)
    return path.replace("[", ".").replace("]", "").replace("'", "")


def _fuse(gm: fx.GraphModule, norm: _Norm, values: dict[fx.Node, Any],
          into: FusionBackend) -> str | None:
    """Rewrite one add + norm; None when done, "" when the norm follows no add, else why not."""
    boundary = _add_and_norm(norm, values)
    if isinstance(boundary, str):
        return boundary
    add, params, output = boundary
    fused_op = FUSED_OPS[norm.op]
    dispatcher = into.dispatcher(fused_op)
    if dispatcher is None:
        return f"no {fused_op} results"
    weights = [values[p] for p in params]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return "traced with gradients (compile under torch.no_grad() to fuse)"
    own = _extract(gm, norm.nodes, params, output)
    total = add.meta["example_value"]
    found = _numerics(norm, own, weights, total.dtype, total.device)
    if found is None:
        return "its numerics match no formula fusionlab computes"
    info, weight, bias = found
    entry = FusedAddNorm(norm.path, fused_op, (info.eps, info.casting, info.offset),
                         lambda x: own(x, *weights), weight, bias, dispatcher, "inference")
    _replace(gm.graph, add, norm.nodes, output, entry.slot)
    into.fused.append(entry)
    return None


def _add_and_norm(norm: _Norm, values: dict[fx.Node, Any]
                  ) -> tuple[fx.Node, list[fx.Node], fx.Node] | str:
    """The residual add the norm reads, its parameter inputs (by name) and its one output node;
    else why not ("" when the norm follows no add)."""
    inside = set(norm.nodes)
    inputs = {i for n in norm.nodes for i in n.all_input_nodes if i not in inside}
    params = sorted((i for i in inputs if _is_parameter(values.get(i))), key=lambda i: i.name)
    activations = [i for i in inputs if i not in params]
    outputs = [n for n in norm.nodes if any(u not in inside for u in n.users)]
    if len(activations) != 1 or not _is_add(activations[0]):
        return ""
    if len(outputs) != 1 or not 1 <= len(params) <= 2:
        return "its nodes have more than one output, or no weight"
    return activations[0], params, outputs[0]


def _is_parameter(value: Any) -> bool:
    """A graph input that holds a norm's weight or bias: a 1-D tensor given to the graph."""
    return isinstance(value, torch.Tensor) and value.dim() == 1


def _is_add(node: fx.Node) -> bool:
    """An add of two tensors of one shape (no alpha): the residual add."""
    if node.op == "call_method":
        is_add = node.target == "add"
    else:
        is_add = node.op == "call_function" and node.target in _ADDS
    if not is_add or node.kwargs or len(node.args) != 2:
        return False
    values = [a.meta.get("example_value") if isinstance(a, fx.Node) else None for a in node.args]
    return all(isinstance(v, torch.Tensor) for v in values) and values[0].shape == values[1].shape


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], params: list[fx.Node],
             output: fx.Node) -> fx.GraphModule:
    """The norm's own nodes as a module called with (x, *params)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = {i for n in nodes for i in n.all_input_nodes if i not in set(nodes)}
    for node in [*(i for i in inputs if i not in params), *params]:
        env[node] = graph.placeholder(node.name)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[output])
    return fx.GraphModule(gm, graph)


def _numerics(norm: _Norm, own: fx.GraphModule, weights: list[torch.Tensor], dtype: torch.dtype,
              device: torch.device) -> tuple[NormInfo, torch.Tensor, torch.Tensor | None] | None:
    """The norm's eps and numerics, and which parameter is the weight: the candidate formula that
    reproduces its own nodes on a random input (eps among the nodes' float constants)."""
    generator = torch.Generator().manual_seed(0)
    hidden = weights[0].shape[-1]
    x = torch.randn((2, hidden), generator=generator).to(dtype=dtype, device=device)
    with torch.no_grad():
        out = own(x, *weights)
    orders = [(weights[0], None)] if len(weights) == 1 else [tuple(weights), tuple(weights[::-1])]
    for eps in _constants(norm.nodes):
        for weight, bias in orders:
            info = numerics_of(norm.op, out, x, weight, bias, eps)
            if info.casting != "unknown":
                return info, weight, bias
    return None


def _constants(nodes: list[fx.Node]) -> list[float]:
    """The float constants among the nodes' arguments (eps is one of them)."""
    found: list[float] = []
    for node in nodes:
        for value in (*node.args, *node.kwargs.values()):
            if isinstance(value, float) and value not in found:
                found.append(value)
    return sorted(found)


def _replace(graph: fx.Graph, add: fx.Node, norm_nodes: list[fx.Node], output: fx.Node,
             slot: int) -> None:
    """add -> norm becomes one fused call: its output replaces the norm's, its sum the add's."""
    a, b = add.args
    assert isinstance(a, fx.Node) and isinstance(b, fx.Node)
    op = torch.ops.fusionlab.patched_add_norm.default
    with graph.inserting_after(add):
        fused = graph.call_function(op, (a, b, slot))
    with graph.inserting_after(fused):
        y = graph.call_function(operator.getitem, (fused, 0))
    with graph.inserting_after(y):
        total = graph.call_function(operator.getitem, (y.args[0], 1))
    fake = a.meta["example_value"]
    with fake.fake_mode:
        fused.meta["example_value"] = op(fake, b.meta["example_value"], slot)
    y.meta["example_value"], total.meta["example_value"] = fused.meta["example_value"]
    output.replace_all_uses_with(y)
    add.replace_all_uses_with(total, delete_user_cb=lambda user: user not in norm_nodes)

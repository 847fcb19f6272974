"""What the measuring path uses, as it was before any plugin ran: a replaced function is found.

`seal()` (the worker calls it after importing the measuring modules and before loading any
plugin) keeps, for every module the harness measures with (fusionlab's own, `time`, `os`,
`random`, `torch`, `torch.nn.functional`) and for `torch.Tensor`, which object each public
or private name holds when it is a function, a class or a module. `replaced()` names the first
one that now holds another object: a plugin that swaps the entropy source, a gate check, a clock
or a competitor's op (wrapping `torch.rms_norm` with a slowdown) is found at the next timing
loop. Plain data (caches, counters) is not compared: the harness changes it itself. One
replacement is torch's own: importing torch._dynamo wraps a few torch functions (e.g.
`torch.manual_seed`) in `torch._disable_dynamo`, which only calls the original; such a wrapper
of the sealed function is accepted.

The dispatcher's kernel tables are sealed too: `seal()` keeps `torch._C._dispatch_dump_table`
of every ATen op in `DISPATCHED_OPS` (those the gate's value checks, the float64 references and
the built-in and naive variants dispatch to), and `dispatcher_changed()` names the first whose
table is no longer as sealed: a plugin that registers its own kernel for `aten::sub.out` (the value
check's subtraction) or re-registers `aten::_fused_rms_norm` (to slow the built-in) changes no
Python name, only the table. The worker then retires (measure/worker.py).

Not seen: modules first imported after the seal are sealed when first checked (a plugin that
replaces something in them before that is not seen), names added (not replaced) anywhere, and
the tables of ATen ops not in `DISPATCHED_OPS` (a variant's own ops are its business).
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType

from fusionlab.measure import rules

_ALWAYS = ("time", "os", "random", "torch", "torch.nn.functional")
_PREFIX = "fusionlab"

_SEALED: dict[str, tuple[object, dict[str, object]]] = {}
_TABLES: dict[str, str] = {}

DISPATCHED_OPS = (
    "_fused_rms_norm", "_fused_rms_norm_backward", "_local_scalar_dense", "_to_copy", "abs",
    "abs_", "add.Scalar", "add.Tensor", "add_.Scalar", "add_.Tensor", "any", "clamp_min_", "clone",
    "copy_", "detach", "div.Scalar", "div.Tensor", "div_.Tensor", "empty.memory_format", "equal",
    "expand", "fill_.Scalar", "gt.Scalar", "gt.Tensor", "is_nonzero", "item", "layer_norm", "max",
    "mean.dim", "min.dim", "mul.Scalar", "mul.Tensor", "mul.out", "native_layer_norm",
    "native_layer_norm_backward", "neg", "normal_", "pow.Tensor_Scalar", "randint.low_generator",
    "randn.generator", "rms_norm", "rsqrt", "select.int", "slice.Tensor", "square", "sub.Tensor",
    "sub.out", "sub_.Tensor", "sum", "sum.dim_IntList", "to.device", "to.dtype", "view",
    "view.dtype", "zero_",
)
"""The ATen ops (overload names) that the gate's checks, the float64 references and the built-in
and naive variants of every op dispatch to on the CPU, forward and backward, collected once by
running them under a TorchDispatchMode and the profiler (tests/test_gate_round5.py checks the
list still covers what the gate and the references dispatch to). About 50 tables: a check costs
a few ms, once per timing loop and once per task."""


def _kept(namespace: dict[str, object]) -> dict[str, object]:
    """The names of a namespace that hold code: functions, builtins, classes, modules."""
    return {
        name: value
        for name, value in namespace.items()
        if callable(value) or inspect.ismodule(value)
    }


def _watched() -> dict[str, object]:
    """Every namespace the measuring path uses, by a name to report: modules and torch.Tensor."""
    found: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if isinstance(module, ModuleType) and (
            name in _ALWAYS or name == _PREFIX or name.startswith(_PREFIX + ".")
        ):
            found[name] = module
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch.Tensor"] = torch.Tensor
    return found


def seal() -> None:
    """Keep what every watched namespace holds now (the names already sealed stay as sealed)."""
    for name, owner in _watched().items():
        if name not in _SEALED:
            _SEALED[name] = (owner, _kept(dict(vars(owner))))
    if not _TABLES and "torch" in sys.modules:
        _TABLES.update(_dump_tables())


def _dump_tables() -> dict[str, str]:
    """The dispatcher's kernel table of every op in DISPATCHED_OPS, as torch prints it."""
    dump = sys.modules["torch"]._C._dispatch_dump_table
    return {name: dump(f"aten::{name}") for name in DISPATCHED_OPS}


def dispatcher_changed() -> str | None:
    """The first op of DISPATCHED_OPS whose kernel table is not as sealed, as `aten::name`, or
    None (sealed now when it was not yet)."""
    if not rules.on("sealed_dispatcher"):
        return None
    seal()
    for name, table in _dump_tables().items():
        if _TABLES.get(name) != table:
            return f"aten::{name}"
    return None


def _dynamo_disabled(value: object, original: object) -> bool:
    """Whether `value` is torch._disable_dynamo(original): a wrapper that only calls it."""
    if getattr(value, "__wrapped__", None) is not original:
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    reference = torch._disable_dynamo(original)
    return getattr(value, "__code__", None) is reference.__code__


def replaced() -> str | None:
    """The first watched name that holds another object than when it was sealed, or None."""
    seal()  # modules imported since the last seal
    for name, (owner, kept) in _SEALED.items():
        now = vars(owner)
        for attribute, original in kept.items():
            value = now.get(attribute, original)
            if value is not original and not _dynamo_disabled(value, original):
                return f"{name}.{attribute}"
    return None

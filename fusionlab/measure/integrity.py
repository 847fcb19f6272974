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

Not seen: modules first imported after the seal are sealed when first checked (a plugin that
replaces something in them before that is not seen), and names added (not replaced) anywhere.
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType

_ALWAYS = ("time", "os", "random", "torch", "torch.nn.functional")
_PREFIX = "fusionlab"

_SEALED: dict[str, tuple[object, dict[str, object]]] = {}


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

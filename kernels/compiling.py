"""torch.compile of an op's naive chain, shared by every op's `compiled` variant.

A compiled function compiles lazily: its forward graph at its first call, its backward graph at
the first backward through it, and once more for each torch thread count it meets (Dynamo guards
on the thread count). The harness times a variant after one untimed first call, and its audit
re-times a slow variant on one thread; a graph compiled inside a measured window shows up there as
the compiler's own subprocess and environment calls. So the first call compiles, untimed, the
forward and backward graphs at the caller's thread count (WarmFirstCall), and the audit makes one
untimed call on one thread before its one-thread retry (measure/audit.py), so a graph for one
thread is compiled only where a retry needs it."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fusionlab.devices import get_device

COMPILE_TUNABLES: dict[str, tuple[Any, ...]] = {
    "mode": ("default", "max-autotune-no-cudagraphs", "reduce-overhead"),
    "dynamic": (False, True),
}


def compile_rejects(shape: tuple[int, ...], params: dict[str, Any], device_type: str) -> str | None:
    """Modes that cannot differ from default here, and what the neuron backend documents."""
    backend = get_device(device_type).compile_backend
    if device_type != "cuda" and params["mode"] != "default":
        return f"mode={params['mode']} only differs from default on CUDA"
    if backend == "neuron" and params["dynamic"]:
        return "backend=neuron documents static shapes only"
    return None


def compiled_copy(
    function: Callable[..., Any], device_type: str, mode: str, dynamic: bool,
    exact_casts: bool = False,
) -> Callable[..., Any]:
    """torch.compile of a private copy of `function` with the device's backend.

    exact_casts: inductor keeps every rounding to a 16-bit dtype between two ops (by default it
    may compute straight through in fp32), as a module with "llama" numerics needs."""
    backend = get_device(device_type).compile_backend
    options: dict[str, Any] = {"dynamic": dynamic}
    if backend == "inductor" and exact_casts:
        # torch.compile takes a mode or options, not both: spell the mode out as its options.
        inductor = {**torch._inductor.list_mode_options(mode, dynamic)}
        options["options"] = {**inductor, "emulate_precision_casts": True}
    elif backend == "inductor":
        options["mode"] = mode
    # Dynamo keeps its compiled graphs, and its recompile limit, per code object: a private copy
    # of the code keeps each kernel's graphs apart, so many shapes never push one past the limit
    # into a silent eager fallback.
    private = types.FunctionType(
        function.__code__.replace(), function.__globals__, closure=function.__closure__
    )
    return WarmFirstCall(torch.compile(private, backend=backend, **options))


class WarmFirstCall:
    """A compiled function whose first call compiles the graphs later calls at the same thread
    count use: forward and, where an input requires grad, backward. Later calls are the compiled
    function's alone."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self._warm = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._warm and not torch.compiler.is_compiling():
            self._warm = True
            _with_backward(self.compiled(*args, **kwargs), args, kwargs.values())
        return self.compiled(*args, **kwargs)


def _tensors(items: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among `items`, and inside tuples and lists among them."""
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found += _tensors(item)
    return found


def _with_backward(out: Any, args: tuple[Any, ...], kwargs: Iterable[Any]) -> None:
    """Run the backward of `out` to the inputs that require grad (compiling its graph), if any."""
    outputs = [t for t in _tensors([out]) if t.requires_grad]
    leaves = [t for t in _tensors([*args, *kwargs]) if t.requires_grad]
    if outputs and leaves:
        torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs],
                            allow_unused=True)

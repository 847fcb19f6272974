"""torch.compile of an op's naive chain, shared by every op's `compiled` variant."""

from __future__ import annotations

import types
from collections.abc import Callable
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
    return torch.compile(private, backend=backend, **options)

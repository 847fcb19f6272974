"""How a hand-written variant picks its kernel: the fused-backward kernel its `backward` tunable
names, or its forward kernel (under its numerics); and the registration of a variant whose fused
backward needs no build (Triton's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from fusionlab.kernels.common.backward_choices import fused_backward
from fusionlab.kernels.common.registration import register_handwritten, with_numerics
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.registry import Kernel


def chosen_kernel(backward: str, fused: Mapping[str, Callable[..., Any]],
                  forward: Callable[..., Any], params: Mapping[str, Any], *,
                  load_fused: Callable[[], object] | None = None,
                  load: Callable[[], object] | None = None, numerics: Numerics | None = None,
                  forward_with: Callable[..., Any] | None = None) -> Kernel:
    """A variant's kernel: the kernel of `fused` that `backward` names (after `load_fused`),
    else `forward` (after `load`), or `forward_with` under numerics other than the default;
    bound to `params` and, unless None, to `numerics`."""
    kernel = fused_backward(backward, fused, load_fused)
    if kernel is not None:
        return with_numerics(kernel, numerics, params)
    if load is not None:
        load()
    if numerics is None or numerics == DEFAULT:
        return with_numerics(forward, None, params)
    assert forward_with is not None, "a kernel taking numerics has a forward_with"
    return with_numerics(forward_with, numerics, params)


def register_with_fused_backward(
    op: str, name: str, kernel_module: ModuleType, forward: Callable[..., Any],
    fused: Callable[..., Any], *, devices: Sequence[str], backward_choices: tuple[str, ...],
    description: str,
) -> None:
    """Register `op`'s variant `name`: the kernel `forward`, or `fused` where its `backward`
    tunable is "fused" (a kernel with a fused backward that needs no build)."""

    def factory(device_type: str, backward: str = "torch-ops", **params: Any) -> Kernel:
        return chosen_kernel(backward, {"fused": fused}, forward, params)

    register_handwritten(op, name, kernel_module, devices=devices, autograd=True,
                         backward_choices=backward_choices, description=description)(factory)

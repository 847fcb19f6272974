"""One declaration registers a hand-written kernel (C++, Triton, NKI) as a variant: its kernel
module says when it can run (`unavailable_reason()`), which tunable values it refuses
(`param_error(shape, **params)`) and what it tunes (`TUNABLES`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from fusionlab.numerics import Numerics
from fusionlab.registry import Kernel, TunableSpace, register_variant

Factory = Callable[..., Kernel]


def register_handwritten(
    op: str,
    name: str,
    kernel_module: ModuleType,
    *,
    devices: Sequence[str],
    autograd: bool,
    tunables: Mapping[str, TunableSpace] | None = None,
    backward_choices: tuple[str, ...] | None = None,
    **options: Any,
) -> Callable[[Factory], Factory]:
    """Decorator: register the factory as `op`'s variant `name`, its availability, parameter
    checks and tunables (default `kernel_module.TUNABLES`) read from `kernel_module`; with
    `backward_choices`, a `backward` tunable swept by the passes with a backward (its value is
    not a forward parameter, so the parameter check never sees it). Other options go to
    register_variant as they are."""
    backward_tunables = None if backward_choices is None else {"backward": backward_choices}

    def check_params(shape: tuple[int, ...], params: Mapping[str, Any],
                     device_type: str) -> str | None:
        if backward_tunables is not None:
            params = {key: value for key, value in params.items() if key != "backward"}
        return kernel_module.param_error(shape, **params)

    return register_variant(
        op,
        name,
        devices=devices,
        tunables=kernel_module.TUNABLES if tunables is None else tunables,
        backward_tunables=backward_tunables,
        available=lambda device_type: kernel_module.unavailable_reason(),
        check_params=check_params,
        autograd=autograd,
        **options,
    )


def with_numerics(kernel: Callable[..., Any], numerics: Numerics | None,
                  params: Mapping[str, Any]) -> Kernel:
    """`kernel` bound to its tunable values, and to the casting and offset of `numerics` unless
    it is None (a kernel that takes neither)."""
    if numerics is None:
        return functools.partial(kernel, **params)
    return functools.partial(kernel, casting=numerics.casting, offset=numerics.offset, **params)

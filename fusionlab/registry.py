"""The registry of ops and their variants, and the ways users add variants to it."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import itertools
import pkgutil
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna.distributions as od
import torch

from fusionlab.devices import device_types
from fusionlab.errors import RegistrationError, UserError
from fusionlab.numerics import CASTING_MODES, DEFAULT, Numerics
from fusionlab.op import OpSpec
from fusionlab.shapes import DTYPES

Kernel = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]
Params = dict[str, Any]
TunableValue = bool | int | float | str  # one value a tunable can take
TunableSpace = Sequence[TunableValue] | od.IntDistribution | od.FloatDistribution
ENTRY_POINT_GROUP = "fusionlab.variants"
# How simple a lowering is, simplest first: a tie goes to the simpler one.
KINDS = ("builtin", "baseline", "compiled", "custom")
_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


@dataclass(frozen=True)
class Variant:
    """One lowering of an op: a factory that does its setup and returns the kernel to time.

    `factory(device_type, **params)` returns a kernel taking the op's inputs. `inplace` maps an
    output to the input it is written into (declared, and checked by the gate). `autograd`: the
    kernel has a backward. `numerics`: the casting modes (fusionlab/numerics.py) it implements;
    a variant declaring more than "none" takes `numerics=Numerics(...)` (any offset) in its
    factory, and is called so whenever the numerics differ from the default.
    `backward_tunables` change only the backward: a sweep of the forward pass leaves them out (the
    factory's default applies), the passes with a backward sweep them with `tunables`
    (`for_pass`)."""

    op: str
    name: str
    factory: Callable[..., Kernel]
    devices: tuple[str, ...]
    tunables: Mapping[str, TunableSpace] = field(default_factory=dict)
    dtypes: tuple[str, ...] = tuple(DTYPES)
    available: Callable[[str], str | None] | None = None
    check_params: Callable[[tuple[int, ...], Params, str], str | None] | None = None
    description: str = ""
    kind: str = "custom"
    inplace: Mapping[str, str] = field(default_factory=dict)
    autograd: bool = False
    numerics: tuple[str, ...] = ("none",)
    backward_tunables: Mapping[str, TunableSpace] = field(default_factory=dict)

    def for_pass(self, with_backward: bool) -> Variant:
        """The variant as a pass sweeps it: with its backward tunables among `tunables` when
        the pass runs a backward, else as it is."""
        if not with_backward or not self.backward_tunables:
            return self
        return replace(
            self, tunables={**self.tunables, **self.backward_tunables}, backward_tunables={}
        )

    def supports(self, numerics: Numerics) -> bool:
        """Whether the kernel can compute with these numerics (see the class docstring)."""
        if numerics == DEFAULT:
            return True
        return self.numerics != ("none",) and numerics.casting in self.numerics

    def unavailable_reason(self, device_type: str) -> str | None:
        """Why this variant cannot run on the device type in this process, or None."""
        if device_type not in self.devices:
            return f"runs on {', '.join(self.devices)} only"
        return self.available(device_type) if self.available else None

    def rejects(self, shape: tuple[int, ...], params: Params, device_type: str) -> str | None:
        """Why these tunable values cannot run here (checked before measuring)."""
        return self.check_params(shape, params, device_type) if self.check_params else None

    def is_finite(self) -> bool:
        return all(_choices(space) is not None for space in self.tunables.values())

    def configurations(self) -> Iterator[Params]:
        """Every combination of tunable values (only for finite spaces)."""
        names = list(self.tunables)
        choice_lists = [_choices(self.tunables[name]) or [] for name in names]
        for values in itertools.product(*choice_lists):
            yield dict(zip(names, values, strict=True))



def _choices(space: TunableSpace) -> list[TunableValue] | None:
    if isinstance(space, od.IntDistribution):
        return list(range(space.low, space.high + 1, space.step))
    if isinstance(space, od.FloatDistribution):
        return None
    return list(space)


_OPS: dict[str, OpSpec] = {}
_VARIANTS: dict[str, dict[str, Variant]] = {}
_loaded_entry_points = False


def register_op(spec: OpSpec) -> OpSpec:
    """Add an op spec to the registry."""
    where = f"op {spec.name!r}"
    if not _NAME.match(spec.name):
        raise RegistrationError(f"{where}: names are lower-case letters, digits, '_' and '-'")
    if not spec.inputs or not spec.outputs:
        raise RegistrationError(f"{where}: an op names at least one input and one output")
    _OPS[spec.name] = spec
    _VARIANTS.setdefault(spec.name, {})
    return spec


def register_variant(
    op: str,
    name: str | None = None,
    *,
    devices: Sequence[str],
    tunables: Mapping[str, TunableSpace] | None = None,
    dtypes: Sequence[str] | None = None,
    available: Callable[[str], str | None] | None = None,
    check_params: Callable[[tuple[int, ...], Params, str], str | None] | None = None,
    description: str = "",
    kind: str = "custom",
    inplace: Mapping[str, str] | None = None,
    autograd: bool | None = None,
    numerics: Sequence[str] = ("none",),
    backward_tunables: Mapping[str, TunableSpace] | None = None,
) -> Callable[[Callable[..., Kernel]], Callable[..., Kernel]]:
    """Decorator: register `factory(device_type, **params) -> kernel` as a variant of `op`.

    `autograd` defaults to True for the pure-torch kinds (baseline, builtin, compiled) that write
    no input, False otherwise: a hand-written kernel says whether it has a backward."""

    def decorate(factory: Callable[..., Kernel]) -> Callable[..., Kernel]:
        variant = Variant(
            op=op,
            name=name or factory.__name__,
            factory=factory,
            devices=tuple(devices),
            tunables=dict(tunables or {}),
            dtypes=tuple(dtypes or DTYPES),
            available=available,
            check_params=check_params,
            description=description or (factory.__doc__ or "").strip().split("\n")[0],
            kind=kind,
            inplace=dict(inplace or {}),
            autograd=kind != "custom" and not inplace if autograd is None else autograd,
            numerics=tuple(numerics),
            backward_tunables=dict(backward_tunables or {}),
        )
        _validate(variant)
        _VARIANTS[op][variant.name] = variant
        return factory

    return decorate


def _validate(variant: Variant) -> None:
    """Refuse a variant that breaks a registration rule, naming the first rule it breaks."""
    for rule in _RULES:
        problem = rule(variant)
        if problem is not None:
            raise RegistrationError(f"variant {variant.op}/{variant.name}: {problem}")


def _op_problem(variant: Variant) -> str | None:
    if variant.op not in _OPS:
        return f"unknown op {variant.op!r}; known ops: {', '.join(_OPS)}"
    return None


def _name_problem(variant: Variant) -> str | None:
    if not _NAME.match(variant.name):
        return "names are lower-case letters, digits, '_' and '-'"
    existing = _VARIANTS[variant.op].get(variant.name)
    if existing is not None and existing.factory.__qualname__ != variant.factory.__qualname__:
        return "that name is taken; pick another name"
    return None


def _kind_problem(variant: Variant) -> str | None:
    known_devices = device_types()
    if not variant.devices or set(variant.devices) - set(known_devices):
        return f"devices must be among {', '.join(known_devices)}"
    if variant.kind not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}"
    return None


def _numerics_problem(variant: Variant) -> str | None:
    if not variant.numerics or set(variant.numerics) - set(CASTING_MODES):
        return f"numerics must be a non-empty subset of {', '.join(CASTING_MODES)}"
    bad_dtypes = set(variant.dtypes) - set(DTYPES)
    if bad_dtypes:
        return f"unknown dtypes {sorted(bad_dtypes)}"
    return None


def _inplace_problem(variant: Variant) -> str | None:
    spec = _OPS[variant.op]
    for output, target in variant.inplace.items():
        if output not in spec.outputs or target not in spec.inputs:
            return (
                f"inplace maps outputs ({', '.join(spec.outputs)}) to inputs "
                f"({', '.join(spec.inputs)}); got {output!r} -> {target!r}"
            )
    if variant.inplace and variant.autograd:
        return "an in-place variant cannot declare autograd"
    return None


def _tunables_problem(variant: Variant) -> str | None:
    if variant.backward_tunables and not variant.autograd:
        return "backward tunables need a variant that declares autograd"
    overlap = set(variant.tunables) & set(variant.backward_tunables)
    if overlap:
        return f"{sorted(overlap)} named as tunable and backward tunable"
    for tunable, space in {**variant.tunables, **variant.backward_tunables}.items():
        problem = _tunable_problem(tunable, space)
        if problem is not None:
            return problem
    return None


def _tunable_problem(tunable: str, space: TunableSpace) -> str | None:
    if not _NAME.match(tunable):
        return f"tunable name {tunable!r} is not a plain name"
    if isinstance(space, (od.IntDistribution, od.FloatDistribution)):
        return None
    if isinstance(space, (str, bytes)) or not isinstance(space, Sequence) or not space:
        return (
            f"tunable {tunable!r} needs a non-empty list of choices or an "
            "optuna Int/FloatDistribution"
        )
    if not all(isinstance(value, (bool, int, float, str)) for value in space):
        return f"tunable {tunable!r} choices must be bool/int/float/str"
    return None


def _factory_problem(variant: Variant) -> str | None:
    return None if callable(variant.factory) else "the factory is not callable"


# In this order: the first rule a variant breaks is the one named.
_RULES: tuple[Callable[[Variant], str | None], ...] = (
    _op_problem, _name_problem, _kind_problem, _inplace_problem, _numerics_problem,
    _tunables_problem, _factory_problem,
)


def _ensure_builtin() -> None:
    """Import every op folder under kernels/ (each registers its op and variants)."""
    package = importlib.import_module("fusionlab.kernels")
    for module in pkgutil.iter_modules(package.__path__):
        if module.ispkg:
            importlib.import_module(f"{package.__name__}.{module.name}")


def get_op(name: str) -> OpSpec:
    """The op spec for a name, or UserError naming the known ops."""
    _ensure_builtin()
    if name not in _OPS:
        raise UserError(f"unknown op {name!r}: known ops are {', '.join(sorted(_OPS))}")
    return _OPS[name]


def op_names() -> list[str]:
    _ensure_builtin()
    return sorted(_OPS)


def variants_of(op: str) -> dict[str, Variant]:
    """All registered variants of an op, by name."""
    get_op(op)
    return dict(_VARIANTS[op])


def get_variant(op: str, name: str) -> Variant:
    variants = variants_of(op)
    if name not in variants:
        raise UserError(f"unknown variant {name!r} of {op}: choose from {', '.join(variants)}")
    return variants[name]


def load_plugin(path: str) -> None:
    """Import a user's Python file that registers variants."""
    _ensure_builtin()
    file = Path(path)
    if not file.is_file():
        raise UserError(f"plugin {path!r} not found: pass the path of a .py file")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
    module_name = f"fusionlab_plugin_{file.stem}_{digest}"
    if module_name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"plugin {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    before = {op: dict(variants) for op, variants in _VARIANTS.items()}
    ops_before = dict(_OPS)
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # a plugin may raise anything, SystemExit included
        del sys.modules[module_name]
        _VARIANTS.clear()
        _VARIANTS.update(before)  # a failed plugin leaves nothing half registered
        _OPS.clear()
        _OPS.update(ops_before)
        if isinstance(error, UserError):
            raise UserError(f"plugin {path!r}: {error}") from None
        raise UserError(
            f"plugin {path!r} failed to import ({type(error).__name__}: {error}); fix the file"
        ) from None


def load_entry_points() -> None:
    """Import the variants that installed packages declare under `fusionlab.variants`."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _ensure_builtin()
    _loaded_entry_points = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except UserError as error:
            raise UserError(f"entry point {entry.name!r} ({entry.value}): {error}") from None
        except Exception as error:
            raise UserError(
                f"entry point {entry.name!r} ({entry.value}) failed to load "
                f"({type(error).__name__}: {error}); fix or uninstall that package"
            ) from None


def ensure_variant_module(module: str) -> None:
    """Import the module that registers a variant (used in worker processes)."""
    if module not in sys.modules and module not in ("__main__", "__mp_main__"):
        importlib.import_module(module)

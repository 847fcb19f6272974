"""The pass a sweep times — forward, backward or forward+backward — as an op of its own.

A pass's op (`pass_spec`) takes the forward's inputs and one upstream gradient per forward
output, and returns the gradients of the inputs the op differentiates (`OpSpec.grad_inputs`),
after the forward's outputs for forward+backward. Its references are the float64 reference's
autograd gradients (`OpSpec.grad_reference`), so every rule of the gate — timed calls checked
as they are drawn, inputs refilled in place, the bandwidth and profiler checks, the audit —
applies to the gradients as it does to the forward.

`PassCall` runs a variant's kernel as the pass. Backward: the forward of each input set is run
once, untimed, and its graph retained; every timed call runs the backward from it with that
set's upstream gradient (`retain_graph=True`). Re-running the forward before each call instead
would put the variant's own code between timed windows, which the gate's gap rule flags as work
hidden from the timer, and would allow one call per timed window. What retaining leaves out of
the figure is freeing the saved tensors at the end of the backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch._functorch.config as functorch_config

from fusionlab.errors import UserError
from fusionlab.op import Inputs, OpSpec, Shape, Tolerance
from fusionlab.registry import Kernel, Variant

FORWARD = "forward"
BACKWARD = "backward"
FORWARD_BACKWARD = "forward+backward"
PASSES = (FORWARD, BACKWARD, FORWARD_BACKWARD)

GRADIENT_FACTOR = 2.0
ROUNDED_SUM_SPREAD = 4.0  # the largest column's error of a sum rounded at every add, in n * u
"""Gradients get this many times the forward's tolerance: a backward chains about twice the
rounding steps of its forward (the statistics again, then the row's correction term)."""

_UPSTREAM_SEED = 1 << 31
"""Upstream gradients are seeded apart from the forward inputs of every set: torch's CPU
generator keeps the low 32 bits of a seed, and input sets are seeded below 2**31 (an offset
of 2**40 would give the upstream gradient the very numbers of x)."""


def check_pass(name: str) -> str:
    """`name` if it is a pass, else a UserError naming the passes."""
    if name not in PASSES:
        raise UserError(f"unknown --pass {name!r}: choose from {', '.join(PASSES)}")
    return name


def check_backward(spec: OpSpec, name: str, variants: Sequence[Variant]) -> None:
    """A pass with a backward needs an op with gradients to check and variants named by the
    user that declare a backward (`variants`: those the user named, none when not named)."""
    if name == FORWARD:
        return
    if not spec.grad_inputs or spec.grad_reference is None:
        raise UserError(
            f"--pass {name}: op {spec.name!r} has no differentiable inputs (its spec declares no "
            "grad_inputs and grad_reference); sweep it with --pass forward"
        )
    lacking = [variant.name for variant in variants if not variant.autograd]
    if lacking:
        raise UserError(
            f"--pass {name}: variant(s) {', '.join(lacking)} of {spec.name} have no backward "
            "(they declare no autograd); drop them from --variants or use --pass forward"
        )


def unsupported_reason(variant: Variant, name: str) -> str | None:
    """Why `variant` cannot be timed in pass `name`, or None."""
    if name == FORWARD or variant.autograd:
        return None
    return f"no backward: the variant declares no autograd, so it cannot run the {name} pass"


@dataclass(frozen=True)
class _Layout:
    """Shapes of one cell's forward inputs (None: not a tensor) and outputs."""

    inputs: tuple[Shape | None, ...]
    outputs: tuple[Shape, ...]


@functools.lru_cache(maxsize=64)
def _layout(spec: OpSpec, shape: Shape, dtype: torch.dtype) -> _Layout:
    inputs = spec.make_inputs(shape, dtype, torch.device("cpu"), 0)
    return _Layout(
        tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs),
        tuple(tuple(t.shape) for t in spec.reference(inputs)),
    )


def gradient_tolerance(spec: OpSpec, shape: Shape, dtype: torch.dtype, name: str) -> Tolerance:
    """The tolerance of input `name`'s gradient: GRADIENT_FACTOR times the forward's. A
    gradient summed over n rows (an input broadcast over them, as a weight is) gets sqrt(n)
    times that absolute term, the growth of a sum's rounding error over n terms of random sign
    (the probabilistic bound of rounding error analysis), plus ROUNDED_SUM_SPREAD * n * u (u the
    dtype's unit roundoff, half its machine epsilon): torch's own 16-bit kernels round each
    partial sum to the dtype, an error of about n * u per column for terms of unit size (the
    inputs' scale), and the largest of thousands of columns lies a few of those out (negligible
    in float32)."""
    base = spec.tolerance(dtype)
    layout = _layout(spec, shape, dtype)
    first = next(s for s in layout.inputs if s is not None)
    own = layout.inputs[spec.inputs.index(name)]
    rows = max(math.prod(first) // max(math.prod(own or (1,)), 1), 1)
    linear = ROUNDED_SUM_SPREAD * rows * torch.finfo(dtype).eps / 2 if rows > 1 else 0.0
    atol = GRADIENT_FACTOR * base.atol * math.sqrt(rows) + linear
    return Tolerance(atol=atol, rtol=GRADIENT_FACTOR * base.rtol)


def grad_names(spec: OpSpec) -> tuple[str, ...]:
    """The pass's gradient outputs: d<input> for each input the op differentiates."""
    return tuple(f"d{name}" for name in spec.grad_inputs)


@functools.lru_cache(maxsize=64)
def pass_spec(spec: OpSpec, name: str, shape: Shape, dtype: torch.dtype) -> OpSpec:
    """The op that pass `name` of `spec` is, at one cell (its tolerances depend on the rows)."""
    if name == FORWARD:
        return spec
    upstream = tuple(f"grad_{output}" for output in spec.outputs)
    gradients = grad_names(spec)
    outputs = (*spec.outputs, *gradients) if name == FORWARD_BACKWARD else gradients
    tolerances = tuple(gradient_tolerance(spec, shape, dtype, n) for n in spec.grad_inputs)
    if name == FORWARD_BACKWARD:
        tolerances = (spec.tolerance(dtype),) * len(spec.outputs) + tolerances
    return replace(
        spec,
        name=f"{spec.name} {name}",
        inputs=(*spec.inputs, *upstream),
        outputs=outputs,
        make_inputs=functools.partial(_make_inputs, spec),
        reference=functools.partial(_reference, spec, name == FORWARD_BACKWARD),
        bytes_moved=functools.partial(_bytes_moved, spec, name == FORWARD_BACKWARD),
        tolerance=lambda _dtype: tolerances,  # type: ignore[arg-type,return-value]
    )


def _make_inputs(
    spec: OpSpec, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int
) -> Inputs:
    """The forward's inputs of `seed`, then one normal upstream gradient per output."""
    generator = torch.Generator().manual_seed(_UPSTREAM_SEED + seed)
    upstream = tuple(
        torch.randn(out, generator=generator).to(device=device, dtype=dtype)
        for out in _layout(spec, shape, dtype).outputs
    )
    return (*spec.make_inputs(shape, dtype, device, seed), *upstream)


def _reference(spec: OpSpec, with_forward: bool, inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The float64 reference's outputs (with_forward) and its autograd gradients."""
    assert spec.grad_reference is not None
    count = len(spec.inputs)
    leaves = tuple(
        item.detach().to("cpu", torch.float64).requires_grad_(name in spec.grad_inputs)
        if isinstance(item, torch.Tensor) else item
        for name, item in zip(spec.inputs, inputs[:count], strict=True)
    )
    with torch.enable_grad():
        outputs = spec.grad_reference(leaves)
        wanted = [leaves[spec.inputs.index(name)] for name in spec.grad_inputs]
        upstream = [g.detach().to("cpu", torch.float64) for g in inputs[count:]]  # type: ignore[union-attr]
        gradients = torch.autograd.grad(outputs, wanted, upstream)
    forward = tuple(out.detach() for out in outputs) if with_forward else ()
    return (*forward, *gradients)


def _bytes_moved(spec: OpSpec, with_forward: bool, shape: Shape, dtype: torch.dtype) -> int:
    """The least a backward moves: it reads every upstream gradient and the saved rows (one
    x-sized tensor) and writes dx; forward+backward adds the forward's bytes. A lower bound,
    so that the bandwidth rule never flags an honest backward."""
    layout = _layout(spec, shape, dtype)
    first = next(s for s in layout.inputs if s is not None)
    elements = sum(math.prod(out) for out in layout.outputs) + 2 * math.prod(first)
    backward = elements * dtype.itemsize
    return backward + (spec.bytes_moved(shape, dtype) if with_forward else 0)


@dataclass
class _Prepared:
    """One input set as the pass calls the variant: its inputs (kept, so their ids stay theirs),
    the arguments with leaves that share the inputs' memory and require grad, those leaves, and
    for the backward the forward's outputs, its graph retained."""

    inputs: tuple[object, ...]
    args: tuple[object, ...]
    leaves: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...] = ()


class PassCall:
    """A variant's kernel run as a pass (see the module docstring); takes the pass op's inputs.
    Harness code: the variant's kernel is the only variant code it calls. Each set's leaves
    (and, for the backward, its forward) are made before timing (`prepare`), so a timed call
    holds only the variant's forward, if timed, and autograd's backward."""

    def __init__(self, kernel: Kernel, spec: OpSpec, name: str) -> None:
        self._kernel, self._spec, self._name = kernel, spec, name
        self._count = len(spec.inputs)
        self._prepared: dict[tuple[int, ...], _Prepared] = {}
        if name == BACKWARD:
            # A torch.compile'd backward that reuses its saved tensors' memory (donated buffers)
            # refuses retain_graph; it may be built at any backward call, so donation is off in
            # this process from here on (it only ever applies to graphs that train).
            functorch_config.donated_buffer = False

    def __call__(self, *args: object) -> tuple[torch.Tensor, ...]:
        forward, upstream = args[: self._count], args[self._count:]
        prepared = self._prepared.get(_key(forward)) or self._prepare(forward)
        if self._name == FORWARD_BACKWARD:
            with torch.enable_grad():
                outputs = self._spec.as_outputs(self._kernel(*prepared.args))
            gradients = torch.autograd.grad(outputs, prepared.leaves, upstream)  # type: ignore[arg-type]
            return (*(out.detach() for out in outputs), *gradients)  # type: ignore[union-attr]
        return torch.autograd.grad(
            prepared.outputs, prepared.leaves, upstream, retain_graph=True  # type: ignore[arg-type]
        )

    def prepare(self, sets: Sequence[Inputs]) -> None:
        """Prepare every set in `sets` not prepared yet; forget the others (a kept forward's
        graph holds its saved tensors)."""
        keys = [_key(inputs[: self._count]) for inputs in sets]
        self._prepared = {key: self._prepared[key] for key in keys if key in self._prepared}
        for inputs in sets:
            if _key(inputs[: self._count]) not in self._prepared:
                self._prepare(inputs[: self._count])

    def forget(self) -> None:
        """Drop every prepared set (their inputs' values were changed in place)."""
        self._prepared = {}

    @property
    def forward_inputs(self) -> int:
        """How many of the pass op's inputs are the forward's (the rest: upstream gradients)."""
        return self._count

    def _prepare(self, forward: tuple[object, ...]) -> _Prepared:
        prepared = self.leaves_of(forward)
        if self._name == BACKWARD:
            prepared.outputs = self.run_forward(prepared)
        self._prepared[_key(forward)] = prepared
        return prepared

    def leaves_of(self, forward: tuple[object, ...]) -> _Prepared:
        """The set's arguments, with fresh leaves for the inputs the op differentiates."""
        args: list[object] = []
        leaves: list[torch.Tensor] = []
        for name, item in zip(self._spec.inputs, forward, strict=True):
            if name in self._spec.grad_inputs and isinstance(item, torch.Tensor):
                item = item.detach().requires_grad_()
                leaves.append(item)
            args.append(item)
        return _Prepared(forward, tuple(args), leaves)

    def run_forward(self, prepared: _Prepared) -> tuple[torch.Tensor, ...]:
        """The variant's forward on the prepared arguments, its graph recorded."""
        with torch.enable_grad():
            return tuple(self._spec.as_outputs(self._kernel(*prepared.args)))  # type: ignore[arg-type]


def _key(forward: Sequence[object]) -> tuple[int, ...]:
    """A set's key: the identity of its objects (kept alive by `_Saved.inputs`, so never
    reused while the entry exists)."""
    return tuple(id(item) for item in forward)


def as_pass(kernel: Kernel, spec: OpSpec, name: str) -> Kernel | PassCall:
    """`kernel` as pass `name` of `spec` (the kernel itself for the forward)."""
    return kernel if name == FORWARD else PassCall(kernel, spec, name)


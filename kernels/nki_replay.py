"""A NumPy MODEL of the few NKI calls our kernels make, to replay their real bodies on CPU.

This is a model of the hardware, not the hardware, and not AWS's simulator: it runs the kernels'
own ``@nki.jit`` Python functions (the same function objects the Neuron path compiles, with their
``nl`` / ``nisa`` globals pointed here) and checks what the official API documents:
every call's arguments bind to the official signature; DMA source and destination hold the same
number of elements; no tile has more than 128 partitions; engines read and write SBUF only; the
SBUF bytes live per partition (allocation to last use) stay within the generation's budget; a
scalar activation bias is refused before NeuronCore-v3; slices stay in bounds; each LNC program's
rows are written exactly once. Values are computed in float32 (the engines' math precision) and
rounded to each destination's dtype (bf16: round to nearest even). It knows nothing of timing,
PSUM, engine queues, or instruction limits it was not told of.

Official signatures, from the NKI API stubs in aws-neuron/aws-neuron-sdk
(nki/api/nki/isa/__init__.py and nki/api/nki/language/__init__.py, commit a3247f5b, "Neuron
Release 2.32.0", NKI 0.6.0; the names used here are unchanged in the NKI 0.7.0 / SDK 2.33 API
pages). Enum defaults are written as None here; their values play no part in the model.
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusionlab.kernels.nki_common import PMAX, SBUF_PARTITION_BYTES

SIGNATURES = {
    "nl.ndarray": "shape, dtype, buffer=SBUF, name='', address=None",
    "nl.program_id": "axis=0",
    "nl.num_programs": "axes=0",
    "nisa.dma_copy": "dst, src, priority=None, oob_mode=None, dge_mode=None, engine=None, "
                     "name=None",
    "nisa.memset": "dst, value, engine=None, name=None",
    "nisa.activation": "dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, "
                       "reduce_cmd=None, name=None",
    "nisa.tensor_reduce": "dst, op, data, axis, negate=False, keepdims=False, name=None",
    "nisa.tensor_scalar": "dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, "
                          "reverse1=False, engine=None, name=None",
    "nisa.tensor_tensor": "dst, data1, data2, op, engine=None, name=None",
    "nisa.scalar_tensor_tensor": "dst, data, op0, operand0, op1, operand1, reverse0=False, "
                                 "reverse1=False, name=None",
}


def _signature(params: str) -> inspect.Signature:
    scope: dict[str, Any] = {"SBUF": "sbuf"}
    exec(f"def stub({params}): pass", scope)  # the official parameter list, verbatim
    return inspect.signature(scope["stub"])


_BOUND = {name: _signature(params) for name, params in SIGNATURES.items()}


class ModelError(AssertionError):
    """A kernel did something the documented NKI API does not allow (as far as the model knows)."""


@dataclass(frozen=True)
class ModelDType:
    """An NKI dtype as the model stores it: float32 values rounded to the dtype on every write."""

    name: str
    itemsize: int

    def round(self, values: np.ndarray) -> np.ndarray:
        v = np.asarray(values, dtype=np.float32)
        if self.name == "float32":
            return v
        if self.name == "float16":
            return v.astype(np.float16).astype(np.float32)
        bits = v.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # nearest even
        return np.where(np.isnan(v), v, rounded.astype(np.uint32).view(np.float32))


DTYPES = {n: ModelDType(n, s) for n, s in (("float32", 4), ("bfloat16", 2), ("float16", 2))}


class _Alloc:
    """One buffer: HBM (counted reads/writes) or SBUF (counted live bytes per partition)."""

    def __init__(self, shape: tuple[int, ...], dtype: ModelDType, buffer: str, step: int) -> None:
        self.shape, self.dtype, self.buffer = shape, dtype, buffer
        self.data = np.full(math.prod(shape), np.nan, dtype=np.float32)
        self.reads = np.zeros(self.data.size, dtype=np.int64)
        self.writes = np.zeros(self.data.size, dtype=np.int64)
        self.first = self.last = step

    @property
    def partition_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class ModelTensor:
    """A view of an allocation: the flat indices of its elements, shaped like the view."""

    def __init__(self, alloc: _Alloc, index: np.ndarray, repeated: bool = False) -> None:
        self._alloc, self._index, self._repeated = alloc, index, repeated

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._index.shape)

    @property
    def dtype(self) -> ModelDType:
        return self._alloc.dtype

    @property
    def buffer(self) -> str:
        return self._alloc.buffer

    def __getitem__(self, key: Any) -> ModelTensor:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > len(self.shape):
            raise ModelError(f"index {key} has more dimensions than shape {self.shape}")
        for k, dim in zip(key, self.shape, strict=False):
            if isinstance(k, slice):
                start, stop = 0 if k.start is None else k.start, dim if k.stop is None else k.stop
                if k.step not in (None, 1) or not 0 <= start <= stop <= dim:
                    raise ModelError(f"slice {k} out of bounds for a dimension of {dim}")
            elif not isinstance(k, int) or not 0 <= k < dim:
                raise ModelError(f"index {k!r} out of bounds for a dimension of {dim}")
        return ModelTensor(self._alloc, self._index[key], self._repeated)

    def broadcast(self, dim: int, size: int) -> ModelTensor:
        """NkiTensor.broadcast: repeat a size-1 dimension (never the partition dim on chip)."""
        if self.shape[dim] != 1:
            raise ModelError(f"broadcast needs size 1 at dim {dim}, shape is {self.shape}")
        if dim == 0 and self.buffer == "sbuf":
            raise ModelError("broadcast along the partition dim of an on-chip tensor")
        shape = list(self.shape)
        shape[dim] = size
        return ModelTensor(self._alloc, np.broadcast_to(self._index, tuple(shape)), True)

    # --- used by the model's instructions only ---
    def values(self) -> np.ndarray:
        return self._alloc.data[self._index]

    def store(self, values: np.ndarray) -> None:
        if self._repeated:
            raise ModelError("writing through a broadcast view")
        flat = self._index.ravel()
        self._alloc.data[flat] = self.dtype.round(np.broadcast_to(values, self.shape)).ravel()
        self._alloc.writes[flat] += 1

    def count_reads(self) -> None:
        if self._repeated:
            np.add.at(self._alloc.reads, self._index.ravel(), 1)
        else:
            self._alloc.reads[self._index.ravel()] += 1


@dataclass
class Replay:
    """What one replay saw: outputs, HBM traffic per input/output, peak SBUF per program."""

    outputs: list[np.ndarray]
    input_reads: list[np.ndarray]  # per input: how often each element was read from HBM
    output_writes: list[np.ndarray]  # per output: how often each element was written
    sbuf_peak: list[int]  # per LNC program, bytes per partition
    calls: dict[str, int] = field(default_factory=dict)


class _Program:
    """The nl / nisa namespaces one LNC program sees, and its bookkeeping."""

    def __init__(self, machine: _Machine, program: int) -> None:
        self.machine, self.program, self.step = machine, program, 0
        self.sbuf: list[_Alloc] = []
        self.shared: list[_Alloc] = []

    def touch(self, name: str, bound: inspect.BoundArguments) -> None:
        self.step += 1
        self.machine.calls[name] = self.machine.calls.get(name, 0) + 1
        for value in bound.arguments.values():
            if isinstance(value, ModelTensor) and value.buffer == "sbuf":
                value._alloc.last = self.step

    def sbuf_peak(self) -> int:
        if not self.sbuf:
            return 0
        deltas = np.zeros(self.step + 2, dtype=np.int64)
        for a in self.sbuf:
            deltas[a.first] += a.partition_bytes
            deltas[a.last + 1] -= a.partition_bytes
        return int(np.cumsum(deltas).max())


def _tile(name: str, t: Any, role: str) -> ModelTensor:
    if not isinstance(t, ModelTensor):
        raise ModelError(f"{name}: {role} must be a tile, got {type(t).__name__}")
    if t.buffer != "sbuf":
        raise ModelError(f"{name}: {role} is in {t.buffer}; engines read and write SBUF")
    if not 1 <= t.shape[0] <= PMAX:
        raise ModelError(f"{name}: {role} has {t.shape[0]} partitions (at most {PMAX})")
    return t


def _per_partition(t: ModelTensor) -> int:
    return math.prod(t.shape[1:])


def _same_layout(name: str, a: ModelTensor, b: ModelTensor, what: str) -> None:
    if a.shape[0] != b.shape[0] or _per_partition(a) != _per_partition(b):
        raise ModelError(f"{name}: {what} differ in layout: {a.shape} vs {b.shape}")


def _column(name: str, operand: Any, data: ModelTensor, role: str, fp32: bool) -> np.ndarray:
    """A scalar constant or an (N, 1) tile broadcast along the free axis."""
    if isinstance(operand, (int, float)) and not isinstance(operand, bool):
        return np.float32(operand)
    t = _tile(name, operand, role)
    if t.shape != (data.shape[0], 1):
        raise ModelError(f"{name}: {role} must be a scalar or ({data.shape[0]}, 1), got {t.shape}")
    if fp32 and t.dtype.name != "float32":
        raise ModelError(f"{name}: {role} must be float32, got {t.dtype.name}")
    return t.values().reshape((t.shape[0],) + (1,) * (len(data.shape) - 1))


_ALU = {"add": np.add, "multiply": np.multiply, "subtract": np.subtract}
_ACT = {"square": np.square, "rsqrt": lambda v: 1.0 / np.sqrt(v), "copy": lambda v: v}


def _alu(name: str, op: Any) -> Callable[[Any, Any], np.ndarray]:
    if getattr(op, "kind", None) != "alu":
        raise ModelError(f"{name}: {op!r} is not an arithmetic ALU operator")
    return _ALU[op.name]


def _apply(fn: Callable[[Any, Any], np.ndarray], a: Any, b: Any, reverse: bool) -> np.ndarray:
    return fn(b, a) if reverse else fn(a, b)


@dataclass(frozen=True)
class _Op:
    name: str
    kind: str  # "alu" or "act"

    def __repr__(self) -> str:
        return f"nl.{self.name}"


class _Machine:
    """Runs a kernel body once per LNC program with model nl / nisa namespaces."""

    def __init__(self, generation: str, nl_names: Sequence[str], nisa_names: Sequence[str]):
        self.generation, self.budget = generation, SBUF_PARTITION_BYTES[generation]
        self.nl_names, self.nisa_names = tuple(nl_names), tuple(nisa_names)
        self.calls: dict[str, int] = {}

    def namespaces(self, p: _Program, programs: int) -> tuple[Any, Any]:
        machine = self

        def call(qual: str, impl: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    bound = _BOUND[qual].bind(*args, **kwargs)
                except TypeError as exc:
                    raise ModelError(f"{qual}{_BOUND[qual]}: {exc}") from None
                bound.apply_defaults()
                p.touch(qual, bound)
                return impl(**bound.arguments)
            return wrapper

        def ndarray(shape: Any, dtype: Any, buffer: Any, name: str, address: Any) -> ModelTensor:
            shape = tuple(int(d) for d in shape)
            if not isinstance(dtype, ModelDType):
                raise ModelError(f"nl.ndarray: dtype must be an nl dtype, got {dtype!r}")
            alloc = _Alloc(shape, dtype, "sbuf" if buffer == "sbuf" else "hbm", p.step)
            if buffer == "sbuf":
                if not 1 <= shape[0] <= PMAX:
                    raise ModelError(f"nl.ndarray: {shape[0]} partitions (at most {PMAX})")
                p.sbuf.append(alloc)
            elif buffer == "shared_hbm":
                alloc = machine.shared_output(p, alloc)
            else:
                raise ModelError(f"nl.ndarray: buffer {buffer!r} is not modelled")
            return ModelTensor(alloc, np.arange(alloc.data.size).reshape(shape))

        def dma_copy(dst: Any, src: Any, **_: Any) -> None:
            for t, role in ((dst, "dst"), (src, "src")):
                if not isinstance(t, ModelTensor):
                    raise ModelError(f"nisa.dma_copy: {role} must be a tensor")
                if t.buffer == "sbuf" and not 1 <= t.shape[0] <= PMAX:
                    raise ModelError(f"nisa.dma_copy: {role} has {t.shape[0]} partitions")
            if math.prod(dst.shape) != math.prod(src.shape):
                raise ModelError(f"nisa.dma_copy: {math.prod(src.shape)} source elements into "
                                 f"{math.prod(dst.shape)} destination elements")
            if src.buffer == "hbm":
                src.count_reads()
            dst.store(src.values().reshape(dst.shape))

        def memset(dst: Any, value: Any, **_: Any) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ModelError(f"nisa.memset: value must be a constant, got {value!r}")
            _tile("nisa.memset", dst, "dst").store(np.float32(value))

        def activation(dst: Any, op: Any, data: Any, bias: Any, scale: Any, reduce_op: Any,
                       reduce_res: Any, reduce_cmd: Any, name: Any) -> None:
            q = "nisa.activation"
            dst, data = _tile(q, dst, "dst"), _tile(q, data, "data")
            _same_layout(q, dst, data, "dst and data")
            if getattr(op, "kind", None) != "act":
                raise ModelError(f"{q}: {op!r} is not an activation function")
            if isinstance(bias, (int, float)) and machine.generation == "trn1":
                raise ModelError(f"{q}: a scalar bias needs NeuronCore-v3 (Trn2) or later")
            b = np.float32(0) if bias is None else _column(q, bias, data, "bias", fp32=False)
            s = _column(q, scale, data, "scale", fp32=True)
            out = _ACT[op.name](data.values() * s + b).astype(np.float32)
            dst.store(out.reshape(dst.shape))
            if reduce_res is not None:
                if reduce_op is not _OPS["add"] or reduce_cmd is not reduce_cmd_model.reset_reduce:
                    raise ModelError(f"{q}: the model supports reduce_op=nl.add with "
                                     "reduce_cmd=reset_reduce only")
                res = _tile(q, reduce_res, "reduce_res")
                if res.shape != (data.shape[0], 1):
                    raise ModelError(f"{q}: reduce_res must be ({data.shape[0]}, 1)")
                res.store(out.reshape(data.shape[0], -1).sum(axis=1, dtype=np.float32)[:, None])

        def tensor_reduce(dst: Any, op: Any, data: Any, axis: Any, negate: bool, keepdims: bool,
                          name: Any) -> None:
            q = "nisa.tensor_reduce"
            dst, data = _tile(q, dst, "dst"), _tile(q, data, "data")
            axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
            if not axes or 0 in axes or axes != tuple(range(len(data.shape) - len(axes),
                                                            len(data.shape))):
                raise ModelError(f"{q}: axis {axis} must be the last free dimension(s)")
            total = _alu(q, op).reduce(data.values(), axis=axes, keepdims=keepdims,
                                       dtype=np.float32)
            if dst.shape != total.shape:
                raise ModelError(f"{q}: dst shape {dst.shape} != reduced shape {total.shape}")
            dst.store(-total if negate else total)

        def tensor_scalar(dst: Any, data: Any, op0: Any, operand0: Any, reverse0: bool, op1: Any,
                          operand1: Any, reverse1: bool, engine: Any, name: Any) -> None:
            q = "nisa.tensor_scalar"
            dst, data = _tile(q, dst, "dst"), _tile(q, data, "data")
            _same_layout(q, dst, data, "dst and data")
            v = _apply(_alu(q, op0), data.values(), _column(q, operand0, data, "operand0", True),
                       reverse0)
            if op1 is not None:
                v = _apply(_alu(q, op1), v, _column(q, operand1, data, "operand1", True), reverse1)
            elif operand1 is not None:
                raise ModelError(f"{q}: operand1 given without op1")
            dst.store(v.reshape(dst.shape))

        def tensor_tensor(dst: Any, data1: Any, data2: Any, op: Any, engine: Any,
                          name: Any) -> None:
            q = "nisa.tensor_tensor"
            dst, a, b = (_tile(q, t, r) for t, r in ((dst, "dst"), (data1, "data1"),
                                                     (data2, "data2")))
            _same_layout(q, a, b, "data1 and data2")
            _same_layout(q, dst, a, "dst and data1")
            dst.store(_alu(q, op)(a.values(), b.values().reshape(a.shape)).reshape(dst.shape))

        def scalar_tensor_tensor(dst: Any, data: Any, op0: Any, operand0: Any, op1: Any,
                                 operand1: Any, reverse0: bool, reverse1: bool,
                                 name: Any) -> None:
            q = "nisa.scalar_tensor_tensor"
            dst, data = _tile(q, dst, "dst"), _tile(q, data, "data")
            other = _tile(q, operand1, "operand1")
            _same_layout(q, dst, data, "dst and data")
            _same_layout(q, other, data, "operand1 and data")
            v = _apply(_alu(q, op0), data.values(), _column(q, operand0, data, "operand0", False),
                       reverse0)
            v = _apply(_alu(q, op1), v, other.values().reshape(data.shape), reverse1)
            dst.store(v.reshape(dst.shape))

        def program_id(axis: int) -> int:
            return p.program

        def num_programs(axes: int) -> int:
            return programs

        reduce_cmd_model = types.SimpleNamespace(reset_reduce="reset_reduce", idle="idle")
        nl_all = {
            "ndarray": call("nl.ndarray", ndarray), "sbuf": "sbuf", "shared_hbm": "shared_hbm",
            "program_id": call("nl.program_id", program_id),
            "num_programs": call("nl.num_programs", num_programs),
            "tile_size": types.SimpleNamespace(pmax=PMAX, sbuf_fmax_bytes=machine.budget),
            **DTYPES, **_OPS,
        }
        nisa_all = {
            "dma_copy": call("nisa.dma_copy", dma_copy), "memset": call("nisa.memset", memset),
            "activation": call("nisa.activation", activation),
            "tensor_reduce": call("nisa.tensor_reduce", tensor_reduce),
            "tensor_scalar": call("nisa.tensor_scalar", tensor_scalar),
            "tensor_tensor": call("nisa.tensor_tensor", tensor_tensor),
            "scalar_tensor_tensor": call("nisa.scalar_tensor_tensor", scalar_tensor_tensor),
            "reduce_cmd": reduce_cmd_model,
        }
        # Only the names the kernel declares: using an undeclared one fails here as it would in
        # the availability check.
        nl_model = types.SimpleNamespace(**{n: nl_all[n] for n in self.nl_names})
        nisa_model = types.SimpleNamespace(**{n: nisa_all[n] for n in self.nisa_names})
        return nl_model, nisa_model

    def shared_output(self, p: _Program, alloc: _Alloc) -> _Alloc:
        """The i-th shared_hbm tensor of every program is one tensor, as on the device."""
        index = len(p.shared)
        if index < len(self.outputs):
            first = self.outputs[index]
            if (first.shape, first.dtype) != (alloc.shape, alloc.dtype):
                raise ModelError("LNC programs allocated different shared_hbm outputs")
            alloc = first
        else:
            self.outputs.append(alloc)
        p.shared.append(alloc)
        return alloc

    def run(self, body: Callable[..., Any], inputs: Sequence[tuple[np.ndarray, str]],
            constants: Sequence[Any], lnc: int) -> Replay:
        self.outputs: list[_Alloc] = []
        tensors = []
        for array, dtype in inputs:
            alloc = _Alloc(tuple(array.shape), DTYPES[dtype], "hbm", 0)
            alloc.data[:] = DTYPES[dtype].round(array.astype(np.float32).ravel())
            tensors.append(ModelTensor(alloc, np.arange(array.size).reshape(array.shape)))
        peaks, returned = [], None
        for program in range(lnc):
            p = _Program(self, program)
            nl_model, nisa_model = self.namespaces(p, lnc)
            scope = {**body.__globals__, "nl": nl_model, "nisa": nisa_model}
            fn = types.FunctionType(body.__code__, scope, body.__name__, body.__defaults__,
                                    body.__closure__)
            result = fn(*tensors, *constants)
            result = result if isinstance(result, tuple) else (result,)
            allocs = [r._alloc for r in result]
            if returned is not None and allocs != returned:
                raise ModelError("LNC programs returned different tensors")
            returned = allocs
            peaks.append(p.sbuf_peak())
            if peaks[-1] > self.budget:
                raise ModelError(f"program {program} holds {peaks[-1]} SBUF bytes per partition, "
                                 f"over the {self.generation} budget of {self.budget}")
        assert returned is not None
        for out in returned:
            if (out.writes != 1).any():
                counts = np.unique(out.writes)
                raise ModelError(f"output elements written {counts.tolist()} times, not once")
        return Replay(
            outputs=[a.data.reshape(a.shape).copy() for a in returned],
            input_reads=[t._alloc.reads.reshape(t.shape) for t in tensors],
            output_writes=[a.writes.reshape(a.shape) for a in returned],
            sbuf_peak=peaks, calls=dict(self.calls),
        )


_OPS = {n: _Op(n, "alu") for n in _ALU} | {n: _Op(n, "act") for n in _ACT}


def replay(body: Callable[..., Any], inputs: Sequence[tuple[np.ndarray, str]],
           constants: Sequence[Any], *, lnc: int, generation: str,
           nl_names: Sequence[str], nisa_names: Sequence[str]) -> Replay:
    """Run `body` (a kernel's real function) on HBM `inputs` (array, dtype name) in the model."""
    return _Machine(generation, nl_names, nisa_names).run(body, inputs, constants, lnc)

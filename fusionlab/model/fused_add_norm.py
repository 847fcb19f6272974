"""One residual add + the norm after it, run as one add_rmsnorm / add_layernorm call: the call's
dispatch table, resolved per key on first use, and checked against the add and norm it replaces.

Used by eager fusion (fusionlab/model/fuse.py: a decoder layer's forward) and by the compile pass
(fusionlab/model/fusion_pass.py: an add and a norm in a dynamo graph). A key gets the winner,
else the next fastest variant of the cell that computes the norm's numerics and reproduces its
(output, sum) - bit for bit in 16-bit dtypes, on the input and on a probe; with none the add and
norm run as before at that key. In-place variants are not used (the caller keeps its inputs)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from fusionlab.model import patched_op
from fusionlab.model.patched_module import (
    PatchRow,
    build_kernel,
    check_numerics_exist,
    must_be_exact,
    numerics_text,
    params_text,
    probe_rows,
    supports,
)
from fusionlab.registry import Kernel, get_op, variants_of
from fusionlab.runtime import Dispatcher
from fusionlab.shapes import DTYPES, format_shape

Pair = tuple[torch.Tensor, torch.Tensor]
Norm = Callable[[torch.Tensor], torch.Tensor]
FUSED_OPS = {"rmsnorm": "add_rmsnorm", "layernorm": "add_layernorm"}


class FusedAddNorm:
    """`run(x, residual) -> (norm(x + residual), x + residual)` for one add + norm."""

    def __init__(self, path: str, op: str, numerics: tuple[float, str, float],
                 own_norm: Norm, weight: torch.Tensor, bias: torch.Tensor | None,
                 dispatcher: Dispatcher, mode: str, norm_call: Norm | None = None) -> None:
        """`numerics`: the norm's (eps, casting, offset); `own_norm`: its own computation, the
        reference; `norm_call`: how the caller runs it where nothing is fused (default own)."""
        self.path, self.op, self.dispatcher, self.mode = path, op, dispatcher, mode
        self.eps, self.casting, self.offset = numerics
        self.own_norm, self.norm_call = own_norm, norm_call or own_norm
        self.weight = weight
        self.bias = bias if bias is not None else torch.zeros_like(weight)
        self.names = get_op(op).inputs
        # (shape, dtype) -> the bound fused kernel, or None to run the add and norm apart
        self.table: dict[tuple[torch.Size, torch.dtype], Callable[..., Pair] | None] = {}
        self.rows: list[PatchRow] = []
        self.kernels: dict[tuple[object, ...], Kernel] = {}
        self.probed: dict[tuple[object, ...], str] = {}
        self.calls = 0  # fused kernel calls that ran, for counting what was fused
        self.slot = patched_op.register(self)

    def run(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        """The fused call: the key's kernel, resolved and checked on first use of the key."""
        call = self.table.get((x.shape, x.dtype), False)
        if call is False:
            call = self._resolve(x, residual)
        if call is None:
            total = x + residual
            return self.norm_call(total), total
        self.calls += 1
        return call(x, residual)

    def original(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        """The add and the norm's own computation, as they ran before fusing."""
        total = x + residual
        return self.own_norm(total), total

    def traced(self, x: torch.Tensor, residual: torch.Tensor) -> Pair:
        """Eager: the table lookup. Traced by torch.compile without gradients: one opaque op whose
        real kernel does the lookup (fusionlab/model/patched_op.py)."""
        if torch.compiler.is_compiling() and not self._wants_grad(x, residual):
            return torch.ops.fusionlab.patched_add_norm(x, residual, self.slot)
        return self.run(x, residual)

    def _wants_grad(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        if not torch.is_grad_enabled():
            return False
        return x.requires_grad or residual.requires_grad or self.weight.requires_grad

    def _caller(self, kernel: Kernel) -> Callable[..., Pair]:
        weight, bias, eps = self.weight, self.bias, self.eps
        if self.names == ("x", "residual", "weight", "eps"):
            return lambda x, residual: kernel(x, residual, weight, eps)
        return lambda x, residual: kernel(x, residual, weight, bias, eps)

    def _resolve(self, x: torch.Tensor, residual: torch.Tensor) -> Callable[..., Pair] | None:
        kernel, row = self._choose(x, residual)
        if row.match == "fallback":
            warnings.warn(f"fusionlab: {row.path} at {row.key} keeps its add and norm apart: "
                          f"{row.why}", stacklevel=4)
        call = None if kernel is None else self._caller(kernel)
        self.table[(x.shape, x.dtype)] = call
        self.rows.append(row)
        return call

    def _choose(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[Kernel | None, PatchRow]:
        dtype = _dtype_name(x.dtype)
        key = f"{format_shape(tuple(x.shape))} {dtype}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason goes into the row and one warning
            choice = self.dispatcher.choose(tuple(x.shape), x.dtype, x.device.type)
        if choice.match == "fallback":
            return None, self._row(key, "(not fused)", "fallback", choice.reason)
        check_numerics_exist(self, dtype)
        refused: list[str] = []
        for name, params in ((choice.variant, choice.params), *choice.alternatives):
            kernel, problem = self._candidate(name, params, x, residual)
            if kernel is not None:
                why = "; ".join(refused + ([choice.reason] if choice.reason else []))
                numerics = "bit-exact" if must_be_exact(x.dtype) else "within tolerance"
                return kernel, self._row(key, name + params_text(params), choice.match, why,
                                         numerics, choice.pass_name)
            refused.append(f"{name}{params_text(params)} {problem}")
        return None, self._row(key, "(not fused)", "fallback",
                               "numerics differ: " + "; ".join(refused))

    def _row(self, key: str, variant: str, match: str, why: str, numerics: str = "",
             pass_name: str = "") -> PatchRow:
        return PatchRow(self.path, self.op, key, variant, match, why, numerics, pass_name)

    def _candidate(self, name: str, params: dict[str, Any], x: torch.Tensor,
                   residual: torch.Tensor) -> tuple[Kernel | None, str]:
        variant = variants_of(self.op).get(name)
        dtype = _dtype_name(x.dtype)
        if variant is None:
            return None, "is not registered in this process"
        if not supports(variant, dtype, self.casting, self.offset):
            return None, f"does not compute {numerics_text(self)} in {dtype}"
        if variant.inplace:
            return None, "writes its inputs in place"
        if self.mode == "training" and not variant.autograd:
            return None, "has no backward"
        built = (name, tuple(sorted(params.items())), x.device.type)
        if built not in self.kernels:
            self.kernels[built] = build_kernel(variant, x.device.type, params, self.casting,
                                               self.offset)
        kernel = self.kernels[built]
        problem = self._disagreement(kernel, x, residual)
        if not problem and must_be_exact(x.dtype):
            probe = (*built, x.dtype)
            if probe not in self.probed:
                rows = probe_rows(x)
                self.probed[probe] = self._disagreement(kernel, rows, 2 * rows.flip(0))
            problem = self.probed[probe]
        return (None, f"disagrees with the add + norm: {problem}") if problem else (kernel, "")

    def _disagreement(self, kernel: Kernel, x: torch.Tensor, residual: torch.Tensor) -> str:
        """Why the kernel's (output, sum) is not the add and norm's own ("" if it is): bit for
        bit in 16-bit dtypes, else within the op's tolerance."""
        tolerance = get_op(self.op).tolerance(x.dtype)
        with torch.no_grad():
            expected = self.original(x, residual)
            try:
                got = get_op(self.op).as_outputs(self._caller(kernel)(x, residual))
            except Exception as error:  # variant code may raise anything: it then is not used
                return f"{type(error).__name__}: {error}"
        for name, have, want in zip(("output", "sum"), got, expected, strict=True):
            if not isinstance(have, torch.Tensor) or have.shape != want.shape:
                return f"wrong {name} shape"
            if have.dtype != want.dtype:
                return f"its {name} is {have.dtype}, the norm's {want.dtype}"
            if must_be_exact(x.dtype):
                differ = int((have != want).sum().item())
                if differ:
                    return f"{differ} of {have.numel()} {name} elements round otherwise"
            elif not torch.allclose(have, want, atol=tolerance.atol, rtol=tolerance.rtol):
                worst = (have.float() - want.float()).abs().max().item()
                return (f"{name} max difference {worst:.3g} beyond atol {tolerance.atol:g} "
                        f"rtol {tolerance.rtol:g}")
        return ""


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)

"""One patched norm module and the choice it records: how a kernel is built for the module's
numerics and called with its parameters, its dispatch table, and the checks a kernel must pass to
replace it (bit for bit in 16-bit dtypes, on the input and on a probe of many rows)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model import patched_op
from fusionlab.model.norm_call import NormCall
from fusionlab.numerics import DEFAULT, Numerics
from fusionlab.registry import Kernel, Variant, get_op, variants_of


@dataclass(frozen=True)
class PatchRow:
    """What one module got at one key, and why."""

    path: str
    op: str
    key: str
    variant: str  # "(module's own)" when it keeps its forward
    match: str  # exact | nearest | fallback
    why: str = ""
    numerics: str = ""  # how the kernel's output compares with the module's own
    pass_name: str = ""  # the sweep pass whose cell chose the variant ("" when none did)


def supports(variant: Variant, dtype: str, casting: str, offset: float) -> bool:
    """Whether a variant computes a module's numerics: it declares them, or the module is float32
    without an offset (every casting mode then rounds alike)."""
    return variant.supports(Numerics(casting, offset)) or (dtype == "float32" and not offset)


def build_kernel(variant: Variant, device_type: str, params: dict[str, Any], casting: str,
                 offset: float) -> Kernel:
    """The variant's kernel, told the module's numerics when it computes them; else (float32, no
    offset: see `supports`) the kernel the sweep timed."""
    numerics = Numerics(casting, offset)
    if numerics == DEFAULT or not variant.supports(numerics):
        return variant.factory(device_type, **params)
    return variant.factory(device_type, numerics=numerics, **params)


class PatchedModule:
    """One captured module: how to call an op kernel with its parameters, and its dispatch table."""

    def __init__(self, path: str, module: nn.Module, call: NormCall,
                 original: Callable[..., object] | None = None) -> None:
        self.path, self.module, self.op = path, module, call.op
        self.eps, self.casting, self.offset = call.eps, call.casting, call.offset
        self.original = original or module.forward
        # (shape, dtype) -> the bound kernel call, or None to keep the module's own forward
        self.table: dict[tuple[torch.Size, torch.dtype], Callable[..., object] | None] = {}
        names = get_op(call.op).inputs
        known = {"x", "weight", "bias", "eps"}
        if set(names) - known:
            raise UserError(f"{path}: op {call.op} takes {names}; only norms of x can be patched")
        self.names = names
        self.resolver: Callable[[torch.Tensor], tuple[Kernel | None, PatchRow]] | None = None
        self.late_rows: list[PatchRow] = []  # keys first seen after patching
        # (variant, params, numerics, device type) -> the built kernel
        self.kernels: dict[tuple[object, ...], Kernel] = {}
        # (variant, params, dtype) -> "" when it rounds like the module on the probe, else why not
        self.probed: dict[tuple[object, ...], str] = {}
        self.slot = patched_op.register(self)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The patched call: the key's kernel, resolved and checked on first use of the key."""
        call = self.table.get((x.shape, x.dtype), False)
        if call is False:  # a key not seen at patch time: resolve and check it once
            call = _resolve_late(self, x)
        if call is None:
            return self.original(x)
        return call(x)

    def args(self, x: torch.Tensor) -> tuple[object, ...]:
        values = {"x": x, "weight": self.module.weight, "bias": self.bias(), "eps": self.eps}
        return tuple(values[name] for name in self.names)

    def bias(self) -> torch.Tensor:
        """The module's bias, or zeros for a norm without one (adding zero changes no bit)."""
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else torch.zeros_like(self.module.weight)

    def caller(self, kernel: Kernel) -> Callable[[torch.Tensor], object]:
        """kernel(x, parameters..., eps) with the parameters bound: the per-call path."""
        weight, eps = self.module.weight, self.eps
        if self.names == ("x", "weight", "eps"):
            return lambda x: kernel(x, weight, eps)
        if self.names == ("x", "weight", "bias", "eps"):
            bias = self.bias()
            return lambda x: kernel(x, weight, bias, eps)
        return lambda x: kernel(*self.args(x))


def _resolve_late(entry: PatchedModule, x: torch.Tensor) -> Callable[..., object] | None:
    assert entry.resolver is not None
    kernel, row = entry.resolver(x)
    if row.match == "fallback":
        warnings.warn(f"fusionlab: {row.path} at {row.key} keeps its own forward: {row.why}",
                      stacklevel=3)
    call = None if kernel is None else entry.caller(kernel)
    entry.table[(x.shape, x.dtype)] = call
    entry.late_rows.append(row)
    return call


def check_numerics_exist(entry: PatchedModule, dtype: str) -> None:
    """Refuse a module whose numerics no variant of its op computes, in one line."""
    if not any(supports(v, dtype, entry.casting, entry.offset)
               for v in variants_of(entry.op).values()):
        raise UserError(
            f"{entry.path}: no {entry.op} variant computes its numerics ({numerics_text(entry)}, "
            f"{dtype}); leave {entry.op} out (ops=...) or add a variant that does"
        )


def numerics_text(entry: PatchedModule) -> str:
    offset = f", weight offset {entry.offset:g}" if entry.offset else ""
    return f"{entry.casting} casting{offset}"


def must_be_exact(dtype: torch.dtype) -> bool:
    """16-bit outputs must equal the module's bit for bit: a one-step difference in a norm's
    output compounds through the layers (float32 keeps the op's tolerance)."""
    return dtype in (torch.float16, torch.bfloat16)


_PROBE_ELEMENTS = 1 << 20


def probe_rows(x: torch.Tensor) -> torch.Tensor:
    """About a million elements like a model's activations (row scales spread over orders of
    magnitude, a few outlier channels): a kernel that sums in another order than the module
    rounds about one element in 1e5 otherwise, so it shows here."""
    generator = torch.Generator().manual_seed(0)
    hidden = x.shape[-1]
    count = max(_PROBE_ELEMENTS // max(hidden, 1), 1)
    rows = torch.randn(count, hidden, generator=generator)
    rows *= torch.exp(2 * torch.randn(count, 1, generator=generator))
    outliers = torch.randint(0, hidden, (max(hidden // 64, 1),), generator=generator)
    rows[:, outliers] *= 20
    return rows.to(dtype=x.dtype, device=x.device)


def params_text(params: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"({text})" if text else ""

"""The patched model: what every module and fused layer got, and undo/redo of the patch."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from fusionlab.model.capture import Capture
from fusionlab.model.fuse import FusedLayer
from fusionlab.model.norms import SkippedNorm
from fusionlab.model.patched_module import PatchedModule, PatchRow


class PatchedModel:
    """The patched model: `.report()`, `.undo()`, `.redo()` (PatchHandle adds the benchmarks)."""

    def __init__(self, model: nn.Module, modules: list[PatchedModule], rows: list[PatchRow],
                 fused: list[str], capture: Capture, winners_source: dict[str, Any],
                 skipped: list[SkippedNorm] | None = None, mode: str = "inference",
                 layers: list[FusedLayer] | None = None) -> None:
        self.model, self.modules, self.rows, self.fused = model, modules, rows, fused
        self.layers = layers or []  # decoder layers whose add + norm run fused (fuse=True)
        self.mode = mode  # "training": every chosen kernel has a backward
        self.skipped = skipped or []  # modules that look like norms and keep their own forward
        self.capture, self.winners_source = capture, winners_source
        self._saved = {m.path: m.module.__dict__.get("forward") for m in modules}
        self._forwards = {m.path: _patched_forward(m) for m in modules}
        self.redo()

    def report(self) -> str:
        """Module (or fused layer), key, chosen variant, exact/nearest/fallback, numerics and
        why (keys resolved after patching included); then the modules that look like norms and
        were not patched, with why; then which layers' adds were fused and which not."""
        rows = self.all_rows()
        headers = ["module", "op", "key", "variant", "match", "numerics", "why"]
        cells = [[r.path, r.op, r.key, r.variant, r.match, r.numerics, r.why] for r in rows]
        if self.mode == "training":  # which pass's sweep chose each module's kernel
            headers.insert(4, "from pass")
            for cell, row in zip(cells, rows, strict=True):
                cell.insert(4, row.pass_name or "-")
        table = tabulate(cells, headers=headers, tablefmt="simple")
        skipped = [f"not patched: {s.path or 'the root'} ({s.module_class}): {s.why}"
                   for s in self.skipped]
        return "\n".join([table, *skipped, *self.fused])

    def all_rows(self) -> list[PatchRow]:
        """The keys resolved at patch time, then those each module (and fused layer) resolved
        on first use."""
        return (self.rows + [r for m in self.modules for r in m.late_rows]
                + [r for layer in self.layers for r in layer.add_norm.rows])

    def fused_calls(self) -> int:
        """How many fused add + norm kernel calls have run (a layer's own add and norm, where it
        keeps them, not counted)."""
        return sum(layer.add_norm.calls for layer in self.layers)

    def undo(self) -> None:
        """Give every module and layer its own forward back."""
        for layer in self.layers:
            layer.undo()
        for entry in self.modules:
            saved = self._saved[entry.path]
            if saved is None:
                entry.module.__dict__.pop("forward", None)
            else:
                entry.module.forward = saved

    def redo(self) -> None:
        """Patch again after `undo` (the choices stay resolved)."""
        for entry in self.modules:
            entry.module.forward = self._forwards[entry.path]
        for layer in self.layers:
            layer.patch()


def _patched_forward(entry: PatchedModule) -> Callable[..., object]:
    """Eager: the table lookup. Traced by torch.compile: one opaque op whose real kernel does the
    lookup at run time, so no shape is specialised on and nothing of the resolution is traced;
    where gradients are wanted the lookup itself is traced, as in eager."""
    run, slot = entry.run, entry.slot
    parameters = list(entry.module.parameters(recurse=False))
    patched_norm = torch.ops.fusionlab.patched_norm

    def forward(self: nn.Module, x: torch.Tensor) -> object:
        if torch.compiler.is_compiling() and not _wants_grad(x, parameters):
            return patched_norm(x, slot)
        return run(x)

    return types.MethodType(forward, entry.module)


def _wants_grad(x: torch.Tensor, parameters: list[nn.Parameter]) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in parameters)

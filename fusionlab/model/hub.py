"""The winners as a Hugging Face `kernels` layer repository: a local folder whose `layers`
(RMSNorm, LayerNorm) dispatch to the winners, so `kernelize(model, mode=Mode.INFERENCE,
device="cpu")` users get them through the mechanism they already use. Each module resolves,
checks against its class's own forward, and caches its choice per key on first use, as `patch`
does; a key without a usable winner runs the class's own forward. `kernelize_norms` reaches every
norm class of a model, naming those it cannot reach."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.norm_call import NormCall
from fusionlab.model.norms import (
    SkippedNorm,
    inspect_norm,
    looks_like_norm,
    norm_op,
    unrecognised_norms,
)
from fusionlab.model.patch import resolver
from fusionlab.model.patched_module import PatchedModule
from fusionlab.runtime import Dispatcher
from fusionlab.search.storage import DEFAULT_STORAGE
from fusionlab.shapes import DTYPES

REPO_NAME = "fusionlab-norms"
LAYER_NAMES = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
_INIT = '''"""fusionlab's winners as a kernels layer repository (written by fusionlab)."""

from fusionlab.model.hub import make_layers

layers = make_layers({source!r})
'''


def write_layer_repository(path: str | Path, *, storage: str | None = None,
                           winners: dict[str, str] | None = None) -> Path:
    """Write a local layer repository at `path` for the winners in `storage` or in winners files
    ({op: file}); use it with `kernels.LocalLayerRepository(repo_path=path, layer_name=...)`."""
    if (storage is None) == (winners is None):
        raise UserError("give the winners' storage or winners files ({op: file}), not both")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    source = {"storage": storage, "winners": winners}
    digest = hashlib.sha1(json.dumps(source, sort_keys=True).encode()).hexdigest()[:10]
    metadata = {"name": REPO_NAME, "id": f"fusionlab_norms_{digest}", "version": 1,
                "license": "Apache-2.0", "python-depends": [], "backend": {"type": "cpu"}}
    (folder / "metadata.json").write_text(json.dumps(metadata, indent=1) + "\n", encoding="utf-8")
    (folder / "__init__.py").write_text(_INIT.format(source=source), encoding="utf-8")
    return folder


def make_layers(source: dict[str, Any]) -> SimpleNamespace:
    """The repository's `layers`: one class per op, whose forward is bound onto each module."""
    dispatchers: dict[str, Dispatcher] = {}

    def dispatcher(op: str) -> Dispatcher:
        if op not in dispatchers:
            winners = (source.get("winners") or {}).get(op)
            dispatchers[op] = (Dispatcher(op, winners=winners) if winners
                               else Dispatcher(op, source.get("storage") or DEFAULT_STORAGE))
        return dispatchers[op]

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        entry = self.__dict__.get("_fusionlab_entry")
        if entry is None:
            entry = self.__dict__["_fusionlab_entry"] = _entry(self, x, dispatcher)
        call = entry.table.get((x.shape, x.dtype), False)
        if call is False:
            kernel, row = entry.resolver(x)
            if row.match == "fallback":
                warnings.warn(f"fusionlab: {type(self).__name__} at {row.key} keeps its own "
                              f"forward: {row.why}", stacklevel=2)
            call = entry.table[(x.shape, x.dtype)] = None if kernel is None else entry.caller(
                kernel
            )
        return entry.original(x) if call is None else call(x)

    classes = {
        name: type(name, (nn.Module,), {"forward": forward, "has_backward": False,
                                        "can_torch_compile": False})
        for name in LAYER_NAMES.values()
    }
    return SimpleNamespace(**classes)


def _entry(module: nn.Module, x: torch.Tensor, dispatcher: Any) -> PatchedModule:
    """The module's numerics, probed against its class's own forward, and its resolver."""
    op = norm_op(module)
    if op is None:
        raise UserError(f"{type(module).__name__} is not a norm fusionlab knows")
    own = type(module).forward.__get__(module)
    info = inspect_norm(module, x, own)
    dtype = next(name for name, value in DTYPES.items() if value == x.dtype)
    call = NormCall(type(module).__name__, type(module).__name__, "module", op, "", tuple(x.shape),
                    dtype, x.device.type, info.eps, info.casting, info.offset, 1)
    entry = PatchedModule(type(module).__name__, module, call, own)
    entry.resolver = resolver(entry, dispatcher(op), "inference")
    return entry



def kernelize_norms(model: nn.Module, repo: str | Path, *, device: str = "cpu",
                    mode: Any = None) -> list[SkippedNorm]:
    """`kernels.kernelize` the model with this layer repository for every norm class it holds
    (default mode: inference); returns every module that looks like a norm and still runs its
    own forward, with why. A class without a kernel layer name (GemmaRMSNorm, nn.LayerNorm) is
    given its class name with `kernels.replace_kernel_forward_from_hub` while kernelize runs."""
    from kernels import Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping

    mapping, unnamed, skipped = _layer_mapping(model, repo, device)
    mode = Mode.INFERENCE if mode is None else mode
    try:
        for cls in unnamed:
            replace_kernel_forward_from_hub(cls, cls.__name__)
        with use_kernel_mapping(mapping):
            kernelize(model, mode=mode, device=device)
    finally:
        for cls in unnamed:
            for attribute in ("kernel_layer_name", "kernel_condition"):
                if attribute in cls.__dict__:
                    delattr(cls, attribute)
    named = {s.path for s in skipped}
    for path, module in model.named_modules():
        if looks_like_norm(module) and path not in named and "_kernel_repo" not in module.__dict__:
            condition = getattr(type(module), "kernel_condition", None)
            why = ("its class's kernel_condition refuses it" if condition and not condition(module)
                   else f"kernels kept its own forward in mode {mode} (the layers have no "
                   "backward and no torch.compile support)")
            skipped.append(SkippedNorm(path, type(module).__name__, why))
    return skipped


def _layer_mapping(model: nn.Module, repo: str | Path, device: str
                   ) -> tuple[dict[str, Any], list[type], list[SkippedNorm]]:
    """The `kernels` mapping that sends every recognised norm class of the model to this layer
    repository (by its kernel layer name, or its class name when it has none), the classes that
    need that name, and the norm-like modules it cannot reach."""
    from kernels import LocalLayerRepository

    mapping: dict[str, Any] = {}
    op_of_layer: dict[str, str] = {}
    unnamed: list[type] = []
    skipped = unrecognised_norms(model)
    for path, module in model.named_modules():
        op = norm_op(module)
        if op is None:
            continue
        cls = type(module)
        layer_name = getattr(cls, "kernel_layer_name", None)
        if layer_name is None:
            layer_name = cls.__name__
            if cls not in unnamed:
                unnamed.append(cls)
        if op_of_layer.setdefault(layer_name, op) != op:
            skipped.append(SkippedNorm(path, cls.__name__, (
                f"its kernel layer name {layer_name!r} is shared with a {op_of_layer[layer_name]} "
                f"class, and it computes {op}"
            )))
            continue
        mapping[layer_name] = {device: LocalLayerRepository(
            repo_path=Path(repo), layer_name=LAYER_NAMES[op]
        )}
    return mapping, unnamed, skipped

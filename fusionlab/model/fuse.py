"""Eager fusion (`patch(..., fuse=True)`): each decoder layer of a known shape
(fusionlab/model/layer_forwards.py) gets a forward whose residual add after the attention and the
norm after it are one add_rmsnorm / add_layernorm call (fusionlab/model/fused_add_norm.py),
resolved per key on first use. Under torch.compile that call is one opaque op."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.fused_add_norm import FUSED_OPS, FusedAddNorm
from fusionlab.model.layer_forwards import LayerShape, decoder_layers, shape_of
from fusionlab.model.norms import inspect_norm, norm_op
from fusionlab.runtime import Dispatcher


class FusedLayer:
    """A decoder layer and its fused forward: `patch()` sets it, `undo()` gives the own back."""

    def __init__(self, path: str, layer: nn.Module, shape: LayerShape,
                 dispatcher: Dispatcher, mode: str) -> None:
        self.path, self.layer, self.shape = path, layer, shape
        norm: nn.Module = getattr(layer, shape.norm)
        info = inspect_norm(norm, _sample(norm))
        bias = getattr(norm, "bias", None)
        self.add_norm = FusedAddNorm(
            path, shape.op, (info.eps, info.casting, info.offset), norm.forward, norm.weight,
            bias if isinstance(bias, torch.Tensor) else None, dispatcher, mode,
            norm_call=norm,  # where nothing is fused, the norm module as it is (patched or not)
        )
        self.own_forward = layer.__dict__.get("forward")
        self.fused_forward = shape.make_forward(layer, self.add_norm.traced, layer.forward)

    def patch(self) -> None:
        self.layer.forward = self.fused_forward

    def undo(self) -> None:
        if self.own_forward is None:
            self.layer.__dict__.pop("forward", None)
        else:
            self.layer.forward = self.own_forward


def fuse_layers(model: nn.Module, dispatcher_for: Callable[[str], Dispatcher],
                mode: str) -> tuple[list[FusedLayer], list[str]]:
    """A FusedLayer for each decoder layer of a known shape (nothing is patched yet), and one line
    saying what is fused and one for each decoder layer that is not, with why. Refused in one line
    when no layer can be fused or there are no results of a fused op the model needs."""
    layers = decoder_layers(model)
    known = [(path, layer, shape) for path, layer in layers
             if (shape := shape_of(layer)) is not None]
    notes = [f"not fused: {path} ({type(layer).__name__}): its forward is none of the known "
             "decoder-layer shapes" for path, layer in layers if shape_of(layer) is None]
    if not known:
        first = f" ({notes[0].removeprefix('not fused: ')})" if notes else ""
        raise UserError(f"fuse=True: {type(model).__name__} has no decoder layer of a known "
                        f"shape{first}; patch without fuse=True")
    dispatchers: dict[str, Dispatcher] = {}
    for op in sorted({shape.op for _, _, shape in known}):
        dispatchers[op] = dispatcher_for(op)
        if not dispatchers[op].has_results():
            raise UserError(f"fuse=True: no {op} results to fuse with; run `fusionlab sweep {op} "
                            "--shapes ROWSxHIDDEN` at the model's shapes first")
    fused = []
    for path, layer, shape in known:
        norm = getattr(layer, shape.norm)
        op = norm_op(norm)
        if op is None or FUSED_OPS[op] != shape.op:
            notes.append(f"not fused: {path}.{shape.norm} ({type(norm).__name__}) is not a norm "
                         f"{shape.op} computes")
            continue
        fused.append(FusedLayer(path, layer, shape, dispatchers[shape.op], mode))
    if fused:
        first = fused[0]
        notes.insert(0, f"fused: {len(fused)} layer(s) ({first.path}, ...): the residual add "
                        f"after the attention + {first.shape.norm} as one {first.shape.op} call; "
                        "the add after the MLP stays apart (it is the layer's output)")
    return fused, notes


def _sample(norm: nn.Module) -> torch.Tensor:
    """A random input in the norm weight's dtype, to probe its numerics."""
    weight = norm.weight
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn((2, weight.shape[0]), generator=generator)
    return sample.to(dtype=weight.dtype, device=weight.device)

"""Every parameter's gradient of a patched model against the unpatched model's, after one
backward from identical weights on the same batch: the largest difference relative to the
reference gradient's largest magnitude, grouped by parameter name with layer indices as `*`."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# Differences allowed, relative to the gradient's largest magnitude, in units of the dtype's
# machine epsilon. In float32 the patched norms' backward sums in another order than autograd's
# chain of the module's own ops and every layer below carries the difference on (honest kernels
# measured up to about 12 eps on a 4-layer Llama): 64 eps, 7.6e-6. In 16-bit dtypes the norms
# compute in float32 and round once, so honest gradients differ by about one rounding: 4 eps,
# 0.031 in bfloat16. A backward that is wrong by a few percent is beyond either.
_EPSILONS = {2: 4, 4: 64}


@dataclass(frozen=True)
class GradientGroup:
    """The parameters of one name pattern: how far their patched gradients are from reference."""

    name: str  # e.g. model.layers.*.input_layernorm.weight
    parameters: int
    max_relative: float  # over the group: max |patched - reference| / max |reference|
    worst: str  # the parameter where it is largest
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_relative <= self.tolerance


def gradient_tolerance(dtype: torch.dtype) -> float:
    """The relative difference allowed for gradients computed in `dtype`."""
    return _EPSILONS.get(dtype.itemsize, 64) * torch.finfo(dtype).eps


def relative_difference(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| / max |want| (inf when only one exists, 0 when neither does)."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    difference = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if scale == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / scale


def compare_gradients(patched: nn.Module, reference: nn.Module) -> list[GradientGroup]:
    """Each parameter group's largest relative gradient difference, in the models' order."""
    wanted = dict(reference.named_parameters())
    groups: dict[str, list[tuple[str, float, torch.dtype]]] = {}
    for name, parameter in patched.named_parameters():
        other = wanted[name]
        if not parameter.requires_grad:
            continue
        pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
        difference = relative_difference(parameter.grad, other.grad)
        groups.setdefault(pattern, []).append((name, difference, parameter.dtype))
    result = []
    for pattern, members in groups.items():
        worst, difference, dtype = max(members, key=lambda member: member[1])
        result.append(GradientGroup(pattern, len(members), difference, worst,
                                    gradient_tolerance(dtype)))
    return result

"""The RMSNorm op spec: y = x * rsqrt(mean(x^2, last dim) + eps) * weight."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusionlab.op import Inputs, OpSpec, Tolerance
from fusionlab.registry import register_op

EPS = 1e-6
_TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}


def make_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> Inputs:
    """Normal activations and a weight around 1 that is far from all ones, from a seed."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), EPS


def reference(inputs: Inputs) -> torch.Tensor:
    """RMSNorm in float64 on the CPU."""
    x, weight, eps = inputs
    assert isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
    x64 = x.detach().to("cpu", torch.float64)
    w64 = weight.detach().to("cpu", torch.float64)
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + float(eps)) * w64  # type: ignore[arg-type]


def bytes_moved(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Read x and weight, write y."""
    numel = 1
    for dim in shape:
        numel *= dim
    return (2 * numel + shape[-1]) * dtype.itemsize


def tolerance(dtype: torch.dtype) -> Tolerance:
    return _TOLERANCES[dtype]


def check_shape(shape: tuple[int, ...]) -> str | None:
    return None if len(shape) >= 1 else "RMSNorm needs at least one dimension"


def key_of(inputs: Sequence[object]) -> tuple[tuple[int, ...], torch.dtype]:
    x = inputs[0]
    assert isinstance(x, torch.Tensor)
    return tuple(x.shape), x.dtype


RMSNORM = register_op(
    OpSpec(
        name="rmsnorm",
        description="RMSNorm over the last dimension, with a learned weight",
        make_inputs=make_inputs,
        reference=reference,
        bytes_moved=bytes_moved,
        tolerance=tolerance,
        check_shape=check_shape,
        key_of=key_of,
        baseline="naive",
        default_variant="builtin",
    )
)

"""An op defined outside fusionlab, as README's "Add your own op" walks through: L2 normalisation
of the last dimension with a learned weight, and two lowerings."""

import math

import torch

from fusionlab import OpSpec, Tolerance, register_op, register_variant


def make_inputs(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype), 1e-12


def reference(inputs):
    x, weight, eps = inputs
    x64, w64 = x.double().cpu(), weight.double().cpu()
    return (x64 / x64.norm(dim=-1, keepdim=True).clamp_min(eps) * w64,)


L2NORM = register_op(OpSpec(
    name="l2norm",
    description="x / ||x||_2 over the last dimension, times a weight",
    inputs=("x", "weight", "eps"),
    outputs=("y",),
    make_inputs=make_inputs,
    reference=reference,
    bytes_moved=lambda shape, dtype: (2 * math.prod(shape) + shape[-1]) * dtype.itemsize,
    tolerance=lambda dtype: Tolerance(1e-4, 1e-4) if dtype == torch.float32
    else Tolerance(1.6e-2, 1.6e-2),
    baseline="naive",
    builtin="normalize",
    default_shapes="8x512,64x512",
    quick_shapes="8x512",
))


@register_variant("l2norm", "naive", devices=("cpu", "cuda"), kind="baseline")
def naive(device_type):
    """Square, sum, sqrt, clamp, divide and multiply as separate ops."""
    def kernel(x, weight, eps):
        h = x.float()
        return (h / (h * h).sum(-1, keepdim=True).sqrt().clamp_min(eps) * weight).to(x.dtype)
    return kernel


@register_variant("l2norm", "normalize", devices=("cpu", "cuda"), kind="builtin")
def normalize(device_type):
    """torch.nn.functional.normalize, then the weight."""
    return lambda x, weight, eps: torch.nn.functional.normalize(x, dim=-1, eps=eps) * weight

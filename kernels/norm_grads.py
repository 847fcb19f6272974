"""Backward of the hand-written norms, in torch ops (any device), and the fake (meta) kernels
their custom ops share. The backward recomputes the statistics in fp32 (float64 for float64
inputs, which is how tests/test_custom_ops.py gradchecks it) from the saved inputs; "llama"
rounding of the normalised row is passed straight through, as autograd does for `.to(dtype)`.

The C++ ops' autograd kernels are C++ (no Python on their forward path) and call the backward
ops registered here, `fusionlab::{rms_norm,layer_norm,add_rms_norm,add_layer_norm}_backward`, so
each formula exists once."""

from __future__ import annotations

from collections.abc import Callable

import torch

Grads = tuple[torch.Tensor, torch.Tensor]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


def rms_norm_grads(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> Grads:
    """(dL/dx, dL/dweight) of y = x * rsqrt(mean(x^2) + eps) * (offset + weight), in fp32/64."""
    dtype = _compute_dtype(x)
    xf, g = x.to(dtype), grad_y.to(dtype)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    normed = xf * rstd
    g_normed = g * (offset + weight.to(dtype))
    grad_x = rstd * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
    return grad_x, _sum_rows(g * normed)


def layer_norm_grads(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dweight, dL/dbias) of y = (x - mean) * rsqrt(var + eps) * weight + bias."""
    dtype = _compute_dtype(x)
    xf, g = x.to(dtype), grad_y.to(dtype)
    centred = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    normed = centred * rstd
    g_normed = g * weight.to(dtype)
    grad_x = rstd * (
        g_normed
        - g_normed.mean(-1, keepdim=True)
        - normed * (g_normed * normed).mean(-1, keepdim=True)
    )
    return grad_x, _sum_rows(g * normed), _sum_rows(g)


def _add_norm_grads(
    norm_grads: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    grad_y: torch.Tensor | None, grad_residual_out: torch.Tensor | None, x: torch.Tensor,
    residual: torch.Tensor, weight: torch.Tensor, vectors: int, round_sum: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(dL/dsum, then the grads of the `vectors` weight-shaped parameters) of (norm(x + residual),
    x + residual), `norm_grads(grad_y, sum)` the norm's; the sum recomputed as the forward formed
    it (rounded to x's dtype if round_sum)."""
    dtype = _compute_dtype(x)
    total = x.to(dtype) + residual.to(dtype)
    if round_sum:
        total = total.to(x.dtype).to(dtype)
    grads: tuple[torch.Tensor, ...] = (torch.zeros_like(total), *(
        torch.zeros(weight.shape, dtype=dtype, device=weight.device) for _ in range(vectors)))
    if grad_y is not None:
        grads = norm_grads(grad_y, total)
    if grad_residual_out is not None:
        grads = (grads[0] + grad_residual_out.to(dtype), *grads[1:])
    return grads


def add_rms_norm_grads(
    grad_y: torch.Tensor | None, grad_residual_out: torch.Tensor | None, x: torch.Tensor,
    residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
    round_sum: bool = False,
) -> Grads:
    """(dL/dsum, dL/dweight) of (rmsnorm(x + residual), x + residual): dL/dx = dL/dresidual =
    dL/dsum. The sum is recomputed as the forward formed it (rounded to x's dtype if round_sum)."""
    grad_total, grad_weight = _add_norm_grads(
        lambda grad, total: rms_norm_grads(grad, total, weight, eps, offset),
        grad_y, grad_residual_out, x, residual, weight, 1, round_sum)
    return grad_total, grad_weight


def add_layer_norm_grads(
    grad_y: torch.Tensor | None, grad_residual_out: torch.Tensor | None, x: torch.Tensor,
    residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dsum, dL/dweight, dL/dbias) of (layernorm(x + residual), x + residual): dL/dx =
    dL/dresidual = dL/dsum, the sum recomputed in fp32 (float64 for float64 inputs)."""
    grad_total, grad_weight, grad_bias = _add_norm_grads(
        lambda grad, total: layer_norm_grads(grad, total, weight, eps),
        grad_y, grad_residual_out, x, residual, weight, 2)
    return grad_total, grad_weight, grad_bias


def empty_like_rows(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of x's shape, dtype and device: what every norm kernel returns."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def row_statistics_like(x: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor of x's shape without its last dim: one statistic (mean, rstd) per row."""
    return torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


@torch.library.custom_op("fusionlab::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dweight) in x's and weight's dtypes."""
    grad_x, grad_weight = rms_norm_grads(grad_y, x, weight, eps, offset)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
      offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_like_rows(x), empty_like_rows(weight)


@torch.library.custom_op("fusionlab::layer_norm_backward", mutates_args=())
def layer_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dweight, dL/dbias) in the inputs' dtypes."""
    grad_x, grad_weight, grad_bias = layer_norm_grads(grad_y, x, weight, eps)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), grad_bias.to(bias.dtype)


@layer_norm_backward.register_fake
def _(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return empty_like_rows(x), empty_like_rows(weight), empty_like_rows(bias)


@torch.library.custom_op("fusionlab::add_rms_norm_backward", mutates_args=())
def add_rms_norm_backward(grad_y: torch.Tensor, grad_residual_out: torch.Tensor,
                          x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, offset: float, round_sum: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dsum, dL/dweight), dL/dsum in x's dtype: it is both dL/dx and dL/dresidual."""
    grad_total, grad_weight = add_rms_norm_grads(grad_y, grad_residual_out, x, residual, weight,
                                                 eps, offset, round_sum)
    return grad_total.to(x.dtype), grad_weight.to(weight.dtype)


@add_rms_norm_backward.register_fake
def _(grad_y: torch.Tensor, grad_residual_out: torch.Tensor, x: torch.Tensor,
      residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
      round_sum: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_like_rows(x), empty_like_rows(weight)


@torch.library.custom_op("fusionlab::add_layer_norm_backward", mutates_args=())
def add_layer_norm_backward(grad_y: torch.Tensor, grad_residual_out: torch.Tensor,
                            x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dsum, dL/dweight, dL/dbias), dL/dsum in x's dtype: both dL/dx and dL/dresidual."""
    grad_total, grad_weight, grad_bias = add_layer_norm_grads(grad_y, grad_residual_out, x,
                                                              residual, weight, eps)
    return grad_total.to(x.dtype), grad_weight.to(weight.dtype), grad_bias.to(bias.dtype)


@add_layer_norm_backward.register_fake
def _(grad_y: torch.Tensor, grad_residual_out: torch.Tensor, x: torch.Tensor,
      residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return empty_like_rows(x), empty_like_rows(weight), empty_like_rows(bias)

"""The fused C++ backward of the C++ add + LayerNorm (csrc/add_layernorm_backward_cpu.cpp): the
operator `fusionlab::add_layer_norm_cpu_backward_fused` (the gradient of the sum x + residual,
which is both dx and dresidual, and per-thread partial dweight and dbias, fp32 accumulation) and
`fusionlab::add_layer_norm_cpu_fused_grad`, add_layer_norm_cpu's forward whose C++ autograd
kernel calls it. The `cpp` variant's `backward` tunable picks it (fusionlab/registry.py: swept
only by the passes with a backward)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, norm_grads
from fusionlab.kernels.add_layernorm import cpu_cpp
from fusionlab.kernels.add_rmsnorm.cpu_backward import BACKWARD_CHOICES
from fusionlab.kernels.common.backward_headers import ADD_NORM_BACKWARD

__all__ = ["BACKWARD_CHOICES", "add_layer_norm_cpp_fused_grad", "load_extension"]

_SOURCES = (Path(__file__).parent / "csrc" / "add_layernorm_backward_cpu.cpp",)
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def load_extension() -> float:
    """Build (first time per cache) or load the forward's and this operator; seconds spent."""
    global _op
    seconds = cpu_cpp.load_extension()
    seconds += cpp_build.load("add_layernorm_backward_cpu", _SOURCES, ADD_NORM_BACKWARD)
    _register_fakes()
    _op = torch.ops.fusionlab.add_layer_norm_cpu_fused_grad.default
    return seconds


@functools.cache
def _register_fakes() -> None:
    torch.library.register_fake("fusionlab::add_layer_norm_cpu_backward_fused")(_fake_backward)
    torch.library.register_fake("fusionlab::add_layer_norm_cpu_fused_grad")(_fake_forward)


def _fake_backward(grad_y: torch.Tensor, grad_residual_out: torch.Tensor | None,
                   x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, rows_per_task: int) -> Triple:
    return (norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(weight),
            norm_grads.empty_like_rows(bias))


def _fake_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor, eps: float, rows_per_task: int, store: str = "auto",
                  stats: str = "welford", row_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def add_layer_norm_cpp_fused_grad(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    rows_per_task: int, store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_cpp.add_layer_norm_cpp, its backward the fused C++ kernel."""
    if _op is None:
        load_extension()
    return _op(x, residual, weight, bias, eps, rows_per_task, store, stats, row_group)

"""The fused C++ backward of the C++ add + RMSNorm (csrc/add_rmsnorm_backward_cpu.cpp): the
operator `fusionlab::add_rms_norm_cpu_backward_fused` (the gradient of the sum x + residual,
which is both dx and dresidual, and a per-thread partial dweight, in one pass over each row's
block, fp32 accumulation) and `fusionlab::add_rms_norm_cpu_fused_grad`, add_rms_norm_cpu's
forward whose C++ autograd kernel calls it. The `cpp` variant's `backward` tunable picks it
(fusionlab/registry.py: swept only by the passes with a backward)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, norm_grads
from fusionlab.kernels.add_rmsnorm import cpu_cpp
from fusionlab.kernels.common.backward_choices import RECOMPUTING_CHOICES
from fusionlab.kernels.common.backward_headers import ADD_NORM_BACKWARD

__all__ = ["BACKWARD_CHOICES", "add_rms_norm_cpp_fused_grad", "load_extension"]

BACKWARD_CHOICES = RECOMPUTING_CHOICES  # the forward saves no statistics: no fused-saved

_SOURCES = (Path(__file__).parent / "csrc" / "add_rmsnorm_backward_cpu.cpp",)
Pair = tuple[torch.Tensor, torch.Tensor]
_op: Callable[..., Pair] | None = None


def load_extension() -> float:
    """Build (first time per cache) or load the forward's and this operator; seconds spent."""
    global _op
    seconds = cpu_cpp.load_extension()
    seconds += cpp_build.load("add_rmsnorm_backward_cpu", _SOURCES, ADD_NORM_BACKWARD)
    _register_fakes()
    _op = torch.ops.fusionlab.add_rms_norm_cpu_fused_grad.default
    return seconds


@functools.cache
def _register_fakes() -> None:
    torch.library.register_fake("fusionlab::add_rms_norm_cpu_backward_fused")(_fake_backward)
    torch.library.register_fake("fusionlab::add_rms_norm_cpu_fused_grad")(_fake_forward)


def _fake_backward(grad_y: torch.Tensor, grad_residual_out: torch.Tensor | None,
                   x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                   offset: float, round_sum: bool, rows_per_task: int) -> Pair:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(weight)


def _fake_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  rows_per_task: int, casting: str = "none", offset: float = 0.0,
                  store: str = "auto") -> Pair:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def add_rms_norm_cpp_fused_grad(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    casting: str = "none", offset: float = 0.0, store: str = "auto",
) -> Pair:
    """cpu_cpp.add_rms_norm_cpp_with, its backward the fused C++ kernel."""
    if _op is None:
        load_extension()
    return _op(x, residual, weight, eps, rows_per_task, casting, offset, store)

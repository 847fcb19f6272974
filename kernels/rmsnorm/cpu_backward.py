"""The fused C++ backward of the C++ RMSNorm (csrc/rmsnorm_backward_cpu.cpp): the operator
`fusionlab::rms_norm_cpu_backward_fused` (dx and a per-thread partial dweight in one pass over
each row's block, fp32 accumulation) and `fusionlab::rms_norm_cpu_fused_grad`, rms_norm_cpu's
forward whose C++ autograd kernel calls it; `fusionlab::rms_norm_cpu_backward_saved`, the same
backward reading each row's rstd saved by `fusionlab::rms_norm_cpu_stats` (whose C++ autograd
kernel calls it). Which backward the `cpp` variant uses is its `backward` tunable, swept only by
the passes with a backward (fusionlab/registry.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, norm_grads
from fusionlab.kernels.common.backward_choices import SAVING_CHOICES
from fusionlab.kernels.common.backward_headers import NORM_BACKWARD
from fusionlab.kernels.rmsnorm import cpu_cpp

BACKWARD_CHOICES = SAVING_CHOICES  # the forward can save each row's rstd: also fused-saved

_SOURCES = (Path(__file__).parent / "csrc" / "rmsnorm_backward_cpu.cpp",)
_op: Callable[..., torch.Tensor] | None = None
_stats_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def load_extension() -> float:
    """Build (first time per cache) or load the forward's and this operator; seconds spent."""
    global _op, _stats_op
    seconds = cpu_cpp.load_extension()
    seconds += cpp_build.load("rmsnorm_backward_cpu", _SOURCES, NORM_BACKWARD)
    _register_fakes()
    _op = torch.ops.fusionlab.rms_norm_cpu_fused_grad.default
    _stats_op = torch.ops.fusionlab.rms_norm_cpu_stats.default
    return seconds


@functools.cache
def _register_fakes() -> None:
    torch.library.register_fake("fusionlab::rms_norm_cpu_backward_fused")(_fake_backward)
    torch.library.register_fake("fusionlab::rms_norm_cpu_fused_grad")(_fake_forward)
    torch.library.register_fake("fusionlab::rms_norm_cpu_backward_saved")(_fake_backward_saved)


def _fake_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   offset: float, rows_per_task: int) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(weight)


def _fake_backward_saved(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor, offset: float,
                         rows_per_task: int) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(weight)


def _fake_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
                  casting: str = "none", offset: float = 0.0,
                  store: str = "auto") -> torch.Tensor:
    return norm_grads.empty_like_rows(x)


def rms_norm_cpp_fused_grad(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int, casting: str = "none",
    offset: float = 0.0, store: str = "auto",
) -> torch.Tensor:
    """cpu_cpp.rms_norm_cpp_with, its backward the fused C++ kernel."""
    if _op is None:
        load_extension()
    return _op(x, weight, eps, rows_per_task, casting, offset, store)


def rms_norm_cpp_saved_stats(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int, casting: str = "none",
    offset: float = 0.0, store: str = "auto",
) -> torch.Tensor:
    """cpu_cpp.rms_norm_cpp_with (bit for bit), saving each row's rstd for the fused backward."""
    if _stats_op is None:
        load_extension()
    return _stats_op(x, weight, eps, rows_per_task, casting, offset, store)[0]

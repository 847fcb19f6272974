"""The fused C++ backward of the C++ LayerNorm (csrc/layernorm_backward_cpu.cpp): the operator
`fusionlab::layer_norm_cpu_backward_fused` (dx and per-thread partial dweight and dbias, fp32
accumulation) and `fusionlab::layer_norm_cpu_fused_grad`, layer_norm_cpu's forward whose C++
autograd kernel calls it; `fusionlab::layer_norm_cpu_backward_saved`, the same backward reading
each row's mean and rstd saved by `fusionlab::layer_norm_cpu_stats` (whose C++ autograd kernel
calls it). The `cpp` variant's `backward` tunable picks it (fusionlab/registry.py:
swept only by the passes with a backward)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, norm_grads
from fusionlab.kernels.common.backward_choices import SAVING_CHOICES as BACKWARD_CHOICES
from fusionlab.kernels.common.backward_headers import NORM_BACKWARD, WELFORD_MOMENTS
from fusionlab.kernels.layernorm import cpu_cpp

__all__ = ["BACKWARD_CHOICES", "layer_norm_cpp_fused_grad", "layer_norm_cpp_saved_stats",
           "load_extension"]

_SOURCES = (Path(__file__).parent / "csrc" / "layernorm_backward_cpu.cpp",)
_HEADERS = (*NORM_BACKWARD, WELFORD_MOMENTS)
_op: Callable[..., torch.Tensor] | None = None
_stats_op: Callable[..., tuple[torch.Tensor, ...]] | None = None


def load_extension() -> float:
    """Build (first time per cache) or load the forward's and this operator; seconds spent."""
    global _op, _stats_op
    seconds = cpu_cpp.load_extension()
    seconds += cpp_build.load("layernorm_backward_cpu", _SOURCES, _HEADERS)
    _register_fakes()
    _op = torch.ops.fusionlab.layer_norm_cpu_fused_grad.default
    _stats_op = torch.ops.fusionlab.layer_norm_cpu_stats.default
    return seconds


@functools.cache
def _register_fakes() -> None:
    torch.library.register_fake("fusionlab::layer_norm_cpu_backward_fused")(_fake_backward)
    torch.library.register_fake("fusionlab::layer_norm_cpu_fused_grad")(_fake_forward)
    torch.library.register_fake("fusionlab::layer_norm_cpu_backward_saved")(_fake_backward_saved)


def _fake_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, rows_per_task: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(weight),
            norm_grads.empty_like_rows(bias))


def _fake_backward_saved(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                         rows_per_task: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fake_backward(grad_y, x, weight, bias, 0.0, rows_per_task)


def _fake_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                  rows_per_task: int, store: str = "auto", stats: str = "welford",
                  row_group: int = 1) -> torch.Tensor:
    return norm_grads.empty_like_rows(x)


def layer_norm_cpp_fused_grad(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> torch.Tensor:
    """cpu_cpp.layer_norm_cpp, its backward the fused C++ kernel."""
    if _op is None:
        load_extension()
    return _op(x, weight, bias, eps, rows_per_task, store, stats, row_group)


def layer_norm_cpp_saved_stats(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> torch.Tensor:
    """cpu_cpp.layer_norm_cpp (bit for bit), saving each row's mean and rstd for the fused
    backward."""
    if _stats_op is None:
        load_extension()
    return _stats_op(x, weight, bias, eps, rows_per_task, store, stats, row_group)[0]

"""Hand-written C++ residual add + LayerNorm for CPU: `fusionlab::add_layer_norm_cpu` (out of
place), reading x and residual once for the statistics of their fp32 sum, then writing
both results; JIT-built and cached by kernels/cpp_build.py. Loading also registers its fake
kernel; its autograd kernel is C++ (its backward is kernels/norm_grads.py's op)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, norm_grads
from fusionlab.kernels.common.backward_headers import FORWARD_HEADERS
from fusionlab.kernels.layernorm import cpu_cpp as layernorm_cpp

TUNABLES = layernorm_cpp.TUNABLES
unavailable_reason = layernorm_cpp.unavailable_reason
param_error = layernorm_cpp.param_error

_SOURCES = (Path(__file__).parent / "csrc" / "add_layernorm_cpu.cpp",)
_HEADERS = (
    Path(__file__).parents[1] / "rmsnorm" / "csrc" / "cpu_norm_common.h",
    Path(__file__).parents[1] / "layernorm" / "csrc" / "welford_moments.h",
    *FORWARD_HEADERS,
)
OP_NAME = "fusionlab::add_layer_norm_cpu"
Pair = tuple[torch.Tensor, torch.Tensor]
_op: Callable[..., Pair] | None = None

__all__ = ["TUNABLES", "add_layer_norm_cpp", "load_extension", "param_error", "unavailable_reason"]


def load_extension() -> float:
    """Build (first time per cache) or load the operator, once per process; seconds spent."""
    global _op
    seconds = cpp_build.load("add_layernorm_cpu", _SOURCES, _HEADERS)
    _register_fake()
    _op = torch.ops.fusionlab.add_layer_norm_cpu.default
    return seconds


@functools.cache
def _register_fake() -> None:
    torch.library.register_fake(OP_NAME)(_fake)


def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
          eps: float, rows_per_task: int, store: str = "auto", stats: str = "welford",
          row_group: int = 1) -> Pair:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def add_layer_norm_cpp(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    rows_per_task: int, store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> Pair:
    """(layernorm(x + residual) * weight + bias, x + residual) as new tensors; inputs are left
    alone; store, stats and row_group as for layernorm (kernels/cpu_store.py)."""
    if _op is None:
        load_extension()
    return _op(x, residual, weight, bias, eps, rows_per_task, store, stats, row_group)

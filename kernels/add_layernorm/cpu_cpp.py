"""Hand-written C++ residual add + LayerNorm for CPU: `fusionlab::add_layer_norm_cpu` (out of
place), reading x and residual once for the statistics of their fp32 sum, then writing
both results; JIT-built and cached by kernels/cpp_build.py. Loading also registers its fake
kernel; its autograd kernel is C++ (its backward is kernels/norm_grads.py's op)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels.common.backward_headers import FORWARD_HEADERS
from fusionlab.kernels.cpp_ops import CppOps, fake_like
from fusionlab.kernels.layernorm import cpu_cpp as layernorm_cpp

TUNABLES = layernorm_cpp.TUNABLES
unavailable_reason = layernorm_cpp.unavailable_reason
param_error = layernorm_cpp.param_error

_OPS = CppOps("add_layernorm_cpu", (Path(__file__).parent / "csrc" / "add_layernorm_cpu.cpp",),
              (Path(__file__).parents[1] / "rmsnorm" / "csrc" / "cpu_norm_common.h",
               Path(__file__).parents[1] / "layernorm" / "csrc" / "welford_moments.h",
               *FORWARD_HEADERS),
              fakes={"add_layer_norm_cpu": fake_like(0, 0)})
load_extension = _OPS.load

__all__ = ["TUNABLES", "add_layer_norm_cpp", "load_extension", "param_error", "unavailable_reason"]


def add_layer_norm_cpp(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    rows_per_task: int, store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layernorm(x + residual) * weight + bias, x + residual) as new tensors; inputs are left
    alone; store, stats and row_group as for layernorm (kernels/cpu_store.py)."""
    return _OPS["add_layer_norm_cpu"](x, residual, weight, bias, eps, rows_per_task, store, stats,
                                      row_group)

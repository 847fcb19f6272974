"""The fused C++ backward of the C++ add + LayerNorm (csrc/add_layernorm_backward_cpu.cpp): the
operator `fusionlab::add_layer_norm_cpu_backward_fused` (the gradient of the sum x + residual,
which is both dx and dresidual, and per-thread partial dweight and dbias, fp32 accumulation) and
`fusionlab::add_layer_norm_cpu_fused_grad`, add_layer_norm_cpu's forward whose C++ autograd
kernel calls it. The `cpp` variant's `backward` tunable picks it (fusionlab/registry.py: swept
only by the passes with a backward)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels.add_layernorm import cpu_cpp
from fusionlab.kernels.add_rmsnorm.cpu_backward import BACKWARD_CHOICES
from fusionlab.kernels.common.backward_headers import ADD_NORM_BACKWARD
from fusionlab.kernels.cpp_ops import CppOps, fake_like

__all__ = ["BACKWARD_CHOICES", "add_layer_norm_cpp_fused_grad", "load_extension"]

_OPS = CppOps("add_layernorm_backward_cpu",
              (Path(__file__).parent / "csrc" / "add_layernorm_backward_cpu.cpp",),
              ADD_NORM_BACKWARD, needs=cpu_cpp.load_extension,
              fakes={"add_layer_norm_cpu_backward_fused": fake_like(2, 4, 5),
                     "add_layer_norm_cpu_fused_grad": fake_like(0, 0)})
load_extension = _OPS.load


def add_layer_norm_cpp_fused_grad(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    rows_per_task: int, store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_cpp.add_layer_norm_cpp, its backward the fused C++ kernel."""
    return _OPS["add_layer_norm_cpu_fused_grad"](x, residual, weight, bias, eps, rows_per_task,
                                                 store, stats, row_group)

"""The fused C++ backward of the C++ add + RMSNorm (csrc/add_rmsnorm_backward_cpu.cpp): the
operator `fusionlab::add_rms_norm_cpu_backward_fused` (the gradient of the sum x + residual,
which is both dx and dresidual, and a per-thread partial dweight, in one pass over each row's
block, fp32 accumulation) and `fusionlab::add_rms_norm_cpu_fused_grad`, add_rms_norm_cpu's
forward whose C++ autograd kernel calls it. The `cpp` variant's `backward` tunable picks it
(fusionlab/registry.py: swept only by the passes with a backward)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels.add_rmsnorm import cpu_cpp
from fusionlab.kernels.common.backward_choices import RECOMPUTING_CHOICES
from fusionlab.kernels.common.backward_headers import ADD_NORM_BACKWARD
from fusionlab.kernels.cpp_ops import CppOps, fake_like

__all__ = ["BACKWARD_CHOICES", "add_rms_norm_cpp_fused_grad", "load_extension"]

BACKWARD_CHOICES = RECOMPUTING_CHOICES  # the forward saves no statistics: no fused-saved

_OPS = CppOps("add_rmsnorm_backward_cpu",
              (Path(__file__).parent / "csrc" / "add_rmsnorm_backward_cpu.cpp",),
              ADD_NORM_BACKWARD, needs=cpu_cpp.load_extension,
              fakes={"add_rms_norm_cpu_backward_fused": fake_like(2, 4),
                     "add_rms_norm_cpu_fused_grad": fake_like(0, 0)})
load_extension = _OPS.load


def add_rms_norm_cpp_fused_grad(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    casting: str = "none", offset: float = 0.0, store: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_cpp.add_rms_norm_cpp_with, its backward the fused C++ kernel."""
    return _OPS["add_rms_norm_cpu_fused_grad"](x, residual, weight, eps, rows_per_task, casting,
                                               offset, store)

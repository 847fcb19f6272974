"""The fused C++ backward of the C++ RMSNorm (csrc/rmsnorm_backward_cpu.cpp): the operator
`fusionlab::rms_norm_cpu_backward_fused` (dx and a per-thread partial dweight in one pass over
each row's block, fp32 accumulation) and `fusionlab::rms_norm_cpu_fused_grad`, rms_norm_cpu's
forward whose C++ autograd kernel calls it; `fusionlab::rms_norm_cpu_backward_saved`, the same
backward reading each row's rstd saved by `fusionlab::rms_norm_cpu_stats` (whose C++ autograd
kernel calls it). Which backward the `cpp` variant uses is its `backward` tunable, swept only by
the passes with a backward (fusionlab/registry.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels.common.backward_choices import SAVING_CHOICES
from fusionlab.kernels.common.backward_headers import NORM_BACKWARD
from fusionlab.kernels.cpp_ops import CppOps, fake_like
from fusionlab.kernels.rmsnorm import cpu_cpp

BACKWARD_CHOICES = SAVING_CHOICES  # the forward can save each row's rstd: also fused-saved

_OPS = CppOps("rmsnorm_backward_cpu",
              (Path(__file__).parent / "csrc" / "rmsnorm_backward_cpu.cpp",),
              NORM_BACKWARD, needs=cpu_cpp.load_extension,
              fakes={"rms_norm_cpu_backward_fused": fake_like(1, 2),
                     "rms_norm_cpu_fused_grad": fake_like(0),
                     "rms_norm_cpu_backward_saved": fake_like(1, 2)})
load_extension = _OPS.load


def rms_norm_cpp_fused_grad(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int, casting: str = "none",
    offset: float = 0.0, store: str = "auto",
) -> torch.Tensor:
    """cpu_cpp.rms_norm_cpp_with, its backward the fused C++ kernel."""
    return _OPS["rms_norm_cpu_fused_grad"](x, weight, eps, rows_per_task, casting, offset, store)


def rms_norm_cpp_saved_stats(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int, casting: str = "none",
    offset: float = 0.0, store: str = "auto",
) -> torch.Tensor:
    """cpu_cpp.rms_norm_cpp_with (bit for bit), saving each row's rstd for the fused backward."""
    return _OPS["rms_norm_cpu_stats"](x, weight, eps, rows_per_task, casting, offset, store)[0]

"""The fused C++ backward of the C++ LayerNorm (csrc/layernorm_backward_cpu.cpp): the operator
`fusionlab::layer_norm_cpu_backward_fused` (dx and per-thread partial dweight and dbias, fp32
accumulation) and `fusionlab::layer_norm_cpu_fused_grad`, layer_norm_cpu's forward whose C++
autograd kernel calls it; `fusionlab::layer_norm_cpu_backward_saved`, the same backward reading
each row's mean and rstd saved by `fusionlab::layer_norm_cpu_stats` (whose C++ autograd kernel
calls it). The `cpp` variant's `backward` tunable picks it (fusionlab/registry.py:
swept only by the passes with a backward)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels.common.backward_choices import SAVING_CHOICES as BACKWARD_CHOICES
from fusionlab.kernels.common.backward_headers import NORM_BACKWARD, WELFORD_MOMENTS
from fusionlab.kernels.cpp_ops import CppOps, fake_like
from fusionlab.kernels.layernorm import cpu_cpp

__all__ = ["BACKWARD_CHOICES", "layer_norm_cpp_fused_grad", "layer_norm_cpp_saved_stats",
           "load_extension"]

_OPS = CppOps("layernorm_backward_cpu",
              (Path(__file__).parent / "csrc" / "layernorm_backward_cpu.cpp",),
              (*NORM_BACKWARD, WELFORD_MOMENTS), needs=cpu_cpp.load_extension,
              fakes={"layer_norm_cpu_backward_fused": fake_like(1, 2, 3),
                     "layer_norm_cpu_fused_grad": fake_like(0),
                     "layer_norm_cpu_backward_saved": fake_like(1, 2, 3)})
load_extension = _OPS.load


def layer_norm_cpp_fused_grad(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> torch.Tensor:
    """cpu_cpp.layer_norm_cpp, its backward the fused C++ kernel."""
    return _OPS["layer_norm_cpu_fused_grad"](x, weight, bias, eps, rows_per_task, store, stats,
                                             row_group)


def layer_norm_cpp_saved_stats(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", stats: str = "welford", row_group: int = 1,
) -> torch.Tensor:
    """cpu_cpp.layer_norm_cpp (bit for bit), saving each row's mean and rstd for the fused
    backward."""
    return _OPS["layer_norm_cpu_stats"](x, weight, bias, eps, rows_per_task, store, stats,
                                        row_group)[0]

"""Hand-written C++ residual add + RMSNorm for CPU: `fusionlab::add_rms_norm_cpu` (out of place)
and `fusionlab::add_rms_norm_cpu_` (in place, vLLM's contract), each reading x and residual once;
JIT-built and cached by kernels/cpp_build.py. The semantics follow vLLM's fused_add_rms_norm
(vllm-project/vllm csrc/layernorm_kernels.cu): variance of the fp32 sum, residual stored rounded.
Loading also registers both ops' fake kernels; the out-of-place op's autograd kernel is C++
(its backward is kernels/norm_grads.py's op); the in-place op has no autograd. The `paths`
overload of the out-of-place op and the in-place op also take `passes` and `task_bytes`
(kernels/cpu_store.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels import cpu_store
from fusionlab.kernels.common.backward_headers import FORWARD_HEADERS
from fusionlab.kernels.cpp_ops import CppOps, fake_inplace, fake_like
from fusionlab.kernels.rmsnorm import cpu_cpp as rmsnorm_cpp

INPLACE_TUNABLES: dict[str, tuple[int | str, ...]] = {
    "rows_per_task": rmsnorm_cpp.ROWS_PER_TASK_CHOICES,
    "passes": cpu_store.PASSES_CHOICES,
    "task_bytes": cpu_store.TASK_BYTES_CHOICES,
}
"""In place, pass 1 has pulled every output line into the cache: stores are always plain."""
TUNABLES: dict[str, tuple[int | str, ...]] = {
    "rows_per_task": INPLACE_TUNABLES["rows_per_task"],
    "store": cpu_store.STORE_CHOICES,
}

unavailable_reason = rmsnorm_cpp.unavailable_reason
param_error = rmsnorm_cpp.param_error

_OPS = CppOps("add_rmsnorm_cpu", (Path(__file__).parent / "csrc" / "add_rmsnorm_cpu.cpp",),
              (rmsnorm_cpp.CSRC / "cpu_norm_common.h", rmsnorm_cpp.CSRC / "torch_order_sum.h",
               *FORWARD_HEADERS),
              fakes={"add_rms_norm_cpu": fake_like(0, 0), "add_rms_norm_cpu.paths": fake_like(0, 0),
                     "add_rms_norm_cpu_": fake_inplace})
load_extension = _OPS.load
Pair = tuple[torch.Tensor, torch.Tensor]


def add_rms_norm_cpp(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """(rmsnorm(x + residual) * weight, x + residual) as new tensors; inputs are left alone;
    store is the kind of output stores, passes the reads of each row, task_bytes with
    rows_per_task the parallel grain (kernels/cpu_store.py)."""
    return _OPS["add_rms_norm_cpu.paths"](x, residual, weight, eps, rows_per_task, store=store,
                                          passes=passes, task_bytes=task_bytes)


def add_rms_norm_cpp_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """In place: residual <- x + residual, x <- rmsnorm(residual) * weight; returns both."""
    _OPS["add_rms_norm_cpu_"](x, residual, weight, eps, rows_per_task, passes=passes,
                              task_bytes=task_bytes)
    return x, residual


def add_rms_norm_cpp_with(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    casting: str, offset: float, store: str = "auto", passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """add_rms_norm_cpp with a layer's numerics (fusionlab/numerics.py): casting and offset."""
    return _OPS["add_rms_norm_cpu.paths"](x, residual, weight, eps, rows_per_task, casting, offset,
                                          store, passes, task_bytes)


def add_rms_norm_cpp_with_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    casting: str, offset: float, passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """add_rms_norm_cpp_ (in place) with a layer's numerics: casting and offset."""
    _OPS["add_rms_norm_cpu_"](x, residual, weight, eps, rows_per_task, casting, offset, passes,
                              task_bytes)
    return x, residual

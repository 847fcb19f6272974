"""Hand-written C++ residual add + RMSNorm for CPU: `fusionlab::add_rms_norm_cpu` (out of place)
and `fusionlab::add_rms_norm_cpu_` (in place, vLLM's contract), each reading x and residual once;
JIT-built and cached by kernels/cpp_build.py. The semantics follow vLLM's fused_add_rms_norm
(vllm-project/vllm csrc/layernorm_kernels.cu): variance of the fp32 sum, residual stored rounded.
Loading also registers both ops' fake kernels; the out-of-place op's autograd kernel is C++
(its backward is kernels/norm_grads.py's op); the in-place op has no autograd. The `paths`
overload of the out-of-place op and the in-place op also take `passes` and `task_bytes`
(kernels/cpu_store.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, cpu_store, norm_grads
from fusionlab.kernels.common.backward_headers import FORWARD_HEADERS

INPLACE_TUNABLES: dict[str, tuple[int | str, ...]] = {
    "rows_per_task": (1, 4, 16, 64),
    "passes": cpu_store.PASSES_CHOICES,
    "task_bytes": cpu_store.TASK_BYTES_CHOICES,
}
"""In place, pass 1 has pulled every output line into the cache: stores are always plain."""
TUNABLES: dict[str, tuple[int | str, ...]] = {
    "rows_per_task": INPLACE_TUNABLES["rows_per_task"],
    "store": cpu_store.STORE_CHOICES,
}

_SOURCES = (Path(__file__).parent / "csrc" / "add_rmsnorm_cpu.cpp",)
_HEADERS = (*(Path(__file__).parents[1] / "rmsnorm" / "csrc" / name
               for name in ("cpu_norm_common.h", "torch_order_sum.h")), *FORWARD_HEADERS)
OP_NAME = "fusionlab::add_rms_norm_cpu"
INPLACE_OP_NAME = "fusionlab::add_rms_norm_cpu_"
Pair = tuple[torch.Tensor, torch.Tensor]
_op: Callable[..., Pair] | None = None
_op_: Callable[..., None] | None = None


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built on this machine, or None; checks the tools, never builds."""
    return cpp_build.unavailable_reason()


def param_error(shape: tuple[int, ...], rows_per_task: int, store: str = "auto",
                passes: str = "two", task_bytes: int = 0) -> str | None:
    """Every rows_per_task >= 1 runs at every shape (it is only parallel_for's grain); "stream"
    only where it can take effect, one pass only where the row stays cached
    (kernels/cpu_store.py)."""
    if rows_per_task < 1:
        return f"rows_per_task must be >= 1, got {rows_per_task}"
    return cpu_store.store_error(shape, store) or cpu_store.path_error(shape, passes, task_bytes)


def load_extension() -> float:
    """Build (first time per cache) or load both operators, once per process; seconds spent."""
    global _op, _op_
    seconds = cpp_build.load("add_rmsnorm_cpu", _SOURCES, _HEADERS)
    _register_fakes()
    _op = torch.ops.fusionlab.add_rms_norm_cpu.paths
    _op_ = torch.ops.fusionlab.add_rms_norm_cpu_.default
    return seconds


@functools.cache
def _register_fakes() -> None:
    torch.library.register_fake(OP_NAME)(_fake)
    torch.library.register_fake(f"{OP_NAME}.paths")(_fake_paths)
    torch.library.register_fake(INPLACE_OP_NAME)(_fake_inplace)


def _fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
          rows_per_task: int, casting: str = "none", offset: float = 0.0,
          store: str = "auto") -> Pair:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def _fake_paths(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                rows_per_task: int, casting: str = "none", offset: float = 0.0,
                store: str = "auto", passes: str = "two", task_bytes: int = 0) -> Pair:
    return norm_grads.empty_like_rows(x), norm_grads.empty_like_rows(x)


def _fake_inplace(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  rows_per_task: int, casting: str = "none", offset: float = 0.0,
                  passes: str = "two", task_bytes: int = 0) -> None:
    return None


def add_rms_norm_cpp(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """(rmsnorm(x + residual) * weight, x + residual) as new tensors; inputs are left alone;
    store is the kind of output stores, passes the reads of each row, task_bytes with
    rows_per_task the parallel grain (kernels/cpu_store.py)."""
    if _op is None:
        load_extension()
    return _op(x, residual, weight, eps, rows_per_task, store=store, passes=passes,
               task_bytes=task_bytes)


def add_rms_norm_cpp_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """In place: residual <- x + residual, x <- rmsnorm(residual) * weight; returns both."""
    if _op_ is None:
        load_extension()
    _op_(x, residual, weight, eps, rows_per_task, passes=passes, task_bytes=task_bytes)
    return x, residual


def add_rms_norm_cpp_with(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    casting: str, offset: float, store: str = "auto", passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """add_rms_norm_cpp with a layer's numerics (fusionlab/numerics.py): casting and offset."""
    if _op is None:
        load_extension()
    return _op(x, residual, weight, eps, rows_per_task, casting, offset, store, passes,
               task_bytes)


def add_rms_norm_cpp_with_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int,
    casting: str, offset: float, passes: str = "two", task_bytes: int = 0,
) -> Pair:
    """add_rms_norm_cpp_ (in place) with a layer's numerics: casting and offset."""
    if _op_ is None:
        load_extension()
    _op_(x, residual, weight, eps, rows_per_task, casting, offset, passes, task_bytes)
    return x, residual

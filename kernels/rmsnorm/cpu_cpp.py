"""Hand-written C++ RMSNorm for CPU: the `fusionlab::rms_norm_cpu` operator, JIT-built on first
use by kernels/cpp_build.py (torch.utils.cpp_extension) and cached so later processes only load.
Loading also registers its fake kernels (torch.compile traces it without a graph break). Its
autograd kernel is C++ (csrc/rmsnorm_cpu.cpp); the backward is kernels/norm_grads.py's op.
`fusionlab::rms_norm_cpu_stats` is the same forward also returning each row's rstd (fp32); its
autograd kernel is cpu_backward.py's. The `paths` overload of `rms_norm_cpu` also takes `passes`
and `task_bytes` (kernels/cpu_store.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, cpu_store
from fusionlab.kernels.common.backward_headers import FORWARD_HEADERS
from fusionlab.kernels.cpp_ops import CppOps, fake_like

ROWS_PER_TASK_CHOICES: tuple[int, ...] = (1, 4, 16, 64)
TUNABLES: dict[str, tuple[int | str, ...]] = {
    "rows_per_task": ROWS_PER_TASK_CHOICES,
    "store": cpu_store.STORE_CHOICES,
}

CSRC = Path(__file__).parent / "csrc"
_OPS = CppOps("rmsnorm_cpu", (CSRC / "rmsnorm_cpu.cpp",),
              (CSRC / "cpu_norm_common.h", CSRC / "torch_order_sum.h", *FORWARD_HEADERS),
              fakes={"rms_norm_cpu": fake_like(0), "rms_norm_cpu.paths": fake_like(0),
                     "rms_norm_cpu_stats": fake_like(0, statistics=1)})
load_extension = _OPS.load
unavailable_reason = cpp_build.unavailable_reason


def param_error(shape: tuple[int, ...], rows_per_task: int, store: str = "auto",
                passes: str = "two", task_bytes: int = 0) -> str | None:
    """Every rows_per_task >= 1 runs at every shape (it is only parallel_for's grain); "stream"
    only where it can take effect, one pass only where the row stays cached
    (kernels/cpu_store.py)."""
    if rows_per_task < 1:
        return f"rows_per_task must be >= 1, got {rows_per_task}"
    return cpu_store.store_error(shape, store) or cpu_store.path_error(shape, passes, task_bytes)


def rms_norm_cpp(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int, store: str = "auto",
    passes: str = "two", task_bytes: int = 0,
) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by weight; rows_per_task and task_bytes set the
    parallel grain, store the kind of output stores, passes the reads of each row
    (kernels/cpu_store.py)."""
    return _OPS["rms_norm_cpu.paths"](x, weight, eps, rows_per_task, store=store, passes=passes,
                                      task_bytes=task_bytes)


def rms_norm_cpp_with(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int, casting: str,
    offset: float, store: str = "auto", passes: str = "two", task_bytes: int = 0,
) -> torch.Tensor:
    """rms_norm_cpp with a module's numerics (fusionlab/numerics.py): casting mode and offset."""
    return _OPS["rms_norm_cpu.paths"](x, weight, eps, rows_per_task, casting, offset, store,
                                      passes, task_bytes)

"""Hand-written C++ LayerNorm for CPU: the `fusionlab::layer_norm_cpu` operator (one read of x for
mean/variance, Welford's or shifted sums, then the normalised write), JIT-built and cached by
kernels/cpp_build.py. Loading also registers its fake kernels; its autograd kernel is C++
(backward: norm_grads.py). `fusionlab::layer_norm_cpu_stats` is the same forward also returning
each row's mean and rstd (fp32); its autograd kernel is cpu_backward.py's. The `paths` overload of
`layer_norm_cpu` also takes `task_bytes` (kernels/cpu_store.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from fusionlab.kernels import cpp_build, cpu_store
from fusionlab.kernels.common.backward_headers import FORWARD_HEADERS
from fusionlab.kernels.cpp_ops import CppOps, fake_like

TUNABLES: dict[str, tuple[int | str, ...]] = {
    "rows_per_task": (1, 4, 16, 64),
    "store": cpu_store.STORE_CHOICES,
    "stats": cpu_store.STATS_CHOICES,
    "row_group": cpu_store.ROW_GROUP_CHOICES,
}

_OPS = CppOps("layernorm_cpu", (Path(__file__).parent / "csrc" / "layernorm_cpu.cpp",),
              (Path(__file__).parents[1] / "rmsnorm" / "csrc" / "cpu_norm_common.h",
               Path(__file__).parent / "csrc" / "welford_moments.h", *FORWARD_HEADERS),
              fakes={"layer_norm_cpu": fake_like(0), "layer_norm_cpu.paths": fake_like(0),
                     "layer_norm_cpu_stats": fake_like(0, statistics=2)})
load_extension = _OPS.load
unavailable_reason = cpp_build.unavailable_reason


def param_error(shape: tuple[int, ...], rows_per_task: int, store: str = "auto",
                stats: str = "welford", row_group: int = 1, task_bytes: int = 0) -> str | None:
    """Every rows_per_task >= 1 runs at every shape (it is only parallel_for's grain); "stream"
    only where it can take effect, row_group 4 only where there are rows to group
    (kernels/cpu_store.py)."""
    if rows_per_task < 1:
        return f"rows_per_task must be >= 1, got {rows_per_task}"
    return (cpu_store.store_error(shape, store) or cpu_store.layout_error(shape, stats, row_group)
            or cpu_store.path_error(shape, "two", task_bytes))


def layer_norm_cpp(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, rows_per_task: int,
    store: str = "auto", stats: str = "welford", row_group: int = 1, task_bytes: int = 0,
) -> torch.Tensor:
    """LayerNorm of x over its last dim, with weight and bias; rows_per_task and task_bytes set
    the grain, store the kind of output stores, stats the row statistics, row_group the rows
    normalised together (kernels/cpu_store.py)."""
    return _OPS["layer_norm_cpu.paths"](x, weight, bias, eps, rows_per_task, store, stats,
                                        row_group, task_bytes)

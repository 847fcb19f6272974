"""Hand-written C++ RMSNorm for CPU: the `fusionlab::rms_norm_cpu` operator, JIT-built on first
use with torch.utils.cpp_extension and cached per user so later processes only load it."""

import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROWS_PER_TASK_CHOICES: tuple[int, ...] = (1, 4, 16, 64)

_SOURCE = Path(__file__).parent / "csrc" / "rmsnorm_cpu.cpp"
# Build for the ISA that ATen itself dispatches to on this CPU (never -march=native): at::vec is
# then real SIMD, and the binary runs on any machine with that ISA. Flags are in the cache key.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_op: Callable[..., torch.Tensor] | None = None


def _cpu_flags() -> set[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split()}


def _build_flags() -> tuple[list[str], list[str]]:
    cflags, ldflags = ["-O3"], []
    if torch.backends.openmp.is_available():
        # Without -fopenmp, ATen's header-only parallel_for silently runs serially. The link
        # resolves to the libgomp torch already loaded (same soname): one OpenMP runtime.
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    isa = torch.backends.cpu.get_cpu_capability()
    if isa in _ISA_FLAGS:
        cflags += [*_ISA_FLAGS[isa], f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    if isa == "AVX512" and "avx512_bf16" in _cpu_flags():
        cflags.append("-mavx512bf16")
    return cflags, ldflags


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built on this machine, or None; checks the tools, never builds."""
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which((compiler.split() or [""])[0]) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed; torch.utils.cpp_extension needs it (pip install ninja)"
    return None


def load_extension() -> float:
    """Build (first time per cache) or load the operator, once per process.

    Returns the seconds this call spent, 0.0 when it was already loaded.
    """
    global _op
    with _lock:
        if _op is not None:
            return 0.0
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"fusionlab C++ RMSNorm kernel unavailable: {reason}")
        start = time.perf_counter()
        cflags, ldflags = _build_flags()
        # The .so links libtorch and libtorch_python: torch and Python versions go in the key.
        python = f"py{sys.version_info.major}.{sys.version_info.minor}"
        key_parts = [_SOURCE.read_text(), torch.__version__, python, *cflags, "|", *ldflags]
        name = f"rmsnorm_cpu_{hashlib.sha256(chr(0).join(key_parts).encode()).hexdigest()[:16]}"
        cache = os.environ.get("FUSIONLAB_CACHE_DIR") or Path.home() / ".cache" / "fusionlab"
        build_dir = Path(cache) / "cpp" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
        )
        _op = torch.ops.fusionlab.rms_norm_cpu.default
        return time.perf_counter() - start


def rms_norm_cpp(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int
) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by weight; rows_per_task is the parallel grain."""
    if _op is None:
        load_extension()
    return _op(x, weight, eps, rows_per_task)

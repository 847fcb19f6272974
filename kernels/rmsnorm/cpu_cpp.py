"""Hand-written C++ RMSNorm for CPU: the `fusionlab::rms_norm_cpu` operator, JIT-built on first
use with torch.utils.cpp_extension and cached per user so later processes only load it."""

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROWS_PER_TASK_CHOICES: tuple[int, ...] = (1, 4, 16, 64)

_SOURCE = Path(__file__).parent / "csrc" / "rmsnorm_cpu.cpp"
# Build for the ISA ATen itself picked on this CPU (never -march=native), so at::vec is real SIMD
# and the binary runs on any machine with that ISA; the flags are part of the cache key.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_loaded = False


def _cflags() -> list[str]:
    # Without -fopenmp, ATen's header-only parallel_for silently runs serially.
    flags = ["-O3", "-fopenmp"] if torch._C.has_openmp else ["-O3"]
    isa = torch.backends.cpu.get_cpu_capability()
    if isa in _ISA_FLAGS:
        flags += [*_ISA_FLAGS[isa], f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    return flags


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built on this machine, or None; checks the tools, never builds."""
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed; torch.utils.cpp_extension needs it (pip install ninja)"
    return None


def load_extension() -> float:
    """Build (first time per cache) or load the operator once per process.

    Returns the seconds this call spent, 0.0 when it was already loaded.
    """
    global _loaded
    if _loaded:
        return 0.0
    with _lock:
        if _loaded:
            return 0.0
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"fusionlab C++ RMSNorm kernel unavailable: {reason}")
        start = time.perf_counter()
        cflags = _cflags()
        # The .so links libtorch and libtorch_python, hence torch and Python versions in the key.
        key_parts = [_SOURCE.read_text(), torch.__version__, sys.implementation.cache_tag, *cflags]
        key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:16]
        name = f"rmsnorm_cpu_{key}"
        cache = os.environ.get("FUSIONLAB_CACHE_DIR") or Path.home() / ".cache" / "fusionlab"
        build_dir = Path(cache) / "cpp" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=cflags,
            # Same soname as torch's bundled libgomp, so the process keeps one OpenMP runtime.
            extra_ldflags=["-fopenmp"] if torch._C.has_openmp else [],
            build_directory=str(build_dir),
            is_python_module=False,
        )
        _loaded = True
        return time.perf_counter() - start


def rms_norm_cpp(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_task: int
) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by weight; rows_per_task is the parallel grain."""
    load_extension()
    return torch.ops.fusionlab.rms_norm_cpu(x, weight, eps, rows_per_task)

"""JIT build (or load) of fusionlab's C++ torch-op extensions, shared by every CPU kernel.

Each extension is cached under `$FUSIONLAB_CACHE_DIR` (default ~/.cache/fusionlab)/cpp/<name>-<hash>
(hash of sources, headers, torch, Python and flags). An fcntl.flock on a lock file in that build
dir serialises processes: the first builds, the others wait and then only load. flock, unlike
torch's own FileBaton (torch/utils/file_baton.py, a lock *file* that a killed builder leaves behind
for ever), is released by the kernel when its holder dies. Every real compile appends
"<name>\\t<pid>\\t<seconds>" to builds.log in the cache dir, so callers can count compiles.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

# Build for the ISA that ATen itself dispatches to on this CPU (never -march=native): at::vec is
# then real SIMD, and the binary runs on any machine with that ISA. Flags are in the cache key.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
ISA_ENV = "FUSIONLAB_CPP_ISA"
"""Environment variable choosing the kernels' vector ISA: auto (ATen's own on this CPU), avx512,
avx2 or scalar (no vector flags: at::vec's portable loops, plain stores only)."""
_ISA_CHOICES = {"auto": None, "avx512": "AVX512", "avx2": "AVX2", "scalar": "DEFAULT"}
_ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")
_STAMP = "built.ok"  # written after a build and load succeeded: a half-built dir has none
LOCK_FILE = "build.flock"  # in each build dir; not "lock": cpp_extension's FileBaton owns that
_lock = threading.Lock()
_loaded: dict[str, Path] = {}  # extension name -> loaded library, for this process
_builds_paid: dict[str, float] = {}  # extension name -> seconds this process built or waited


def cache_dir() -> Path:
    """Root of fusionlab's per-user build cache."""
    return Path(os.environ.get("FUSIONLAB_CACHE_DIR") or Path.home() / ".cache" / "fusionlab")


def _cpu_flags() -> set[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split()}


def _native_isa() -> str:
    """The widest ISA of _ISA_FLAGS that ATen dispatches to here, else DEFAULT."""
    isa = torch.backends.cpu.get_cpu_capability()
    return isa if isa in _ISA_FLAGS else "DEFAULT"


def _wanted_isa() -> str:
    return os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"


def isa_error() -> str | None:
    """What is wrong with $FUSIONLAB_CPP_ISA on this CPU, or None."""
    wanted = _wanted_isa()
    if wanted not in _ISA_CHOICES:
        return f"{ISA_ENV}={wanted!r}: use one of {', '.join(_ISA_CHOICES)}"
    isa = _ISA_CHOICES[wanted]
    if isa is not None and _ISA_ORDER.index(isa) > _ISA_ORDER.index(_native_isa()):
        return f"{ISA_ENV}={wanted}: this CPU (as torch sees it) goes up to {_native_isa()}"
    return None


def vector_isa() -> str:
    """The ISA the kernels are built for: AVX512, AVX2 or DEFAULT (scalar), per $FUSIONLAB_CPP_ISA
    (auto: ATen's own); call isa_error() first."""
    return _ISA_CHOICES.get(_wanted_isa()) or _native_isa()


def build_flags() -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) for this CPU, this torch build and vector_isa()."""
    cflags, ldflags = ["-O3"], []
    if torch.backends.openmp.is_available():
        # Without -fopenmp, ATen's header-only parallel_for silently runs serially. The link
        # resolves to the libgomp torch already loaded (same soname): one OpenMP runtime.
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    isa = vector_isa()
    if isa in _ISA_FLAGS:
        cflags += [*_ISA_FLAGS[isa], f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    if isa == "AVX512" and "avx512_bf16" in _cpu_flags():
        cflags.append("-mavx512bf16")
    return cflags, ldflags


def unavailable_reason() -> str | None:
    """Why no extension can be built on this machine, or None; checks the tools, never builds."""
    problem = isa_error()
    if problem is not None:
        return problem
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which((compiler.split() or [""])[0]) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed; torch.utils.cpp_extension needs it (pip install ninja)"
    return None


def build_dir(name: str, sources: Sequence[Path], headers: Sequence[Path] = ()) -> Path:
    """The cache folder of this exact build (content, toolchain and flags in its name)."""
    cflags, ldflags = build_flags()
    # The .so links libtorch and libtorch_python: torch and Python versions go in the key.
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    texts = [p.read_text() for p in (*sources, *headers)]
    key = chr(0).join([*texts, torch.__version__, python, *cflags, "|", *ldflags])
    return cache_dir() / "cpp" / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load(name: str, sources: Sequence[Path], headers: Sequence[Path] = ()) -> float:
    """Build (first time per cache) or load the extension `name`, once per process.

    `headers` are hashed into the key and their folders put on the include path. Returns the
    seconds this call spent, 0.0 when the extension was already loaded in this process; the part
    that was a build (this process's, or the wait for another's) is in builds_paid().
    """
    with _lock:
        if name in _loaded:
            return 0.0
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"fusionlab C++ extension {name!r} unavailable: {reason}")
        start = time.perf_counter()
        folder = build_dir(name, sources, headers)
        library = folder / f"{folder.name}.so"
        folder.mkdir(parents=True, exist_ok=True)
        built_before = (folder / _STAMP).exists()
        with open(folder / LOCK_FILE, "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # blocks while another process builds
            if (folder / _STAMP).exists():
                if not built_before:  # another process built it while this one waited
                    _builds_paid[name] = time.perf_counter() - start
                torch.ops.load_library(str(library))
            else:
                _build(folder, sources, headers)
                seconds = time.perf_counter() - start
                _builds_paid[name] = seconds
                (folder / _STAMP).touch()
                with open(cache_dir() / "builds.log", "a") as log:
                    log.write(f"{folder.name}\t{os.getpid()}\t{seconds:.2f}\n")
        _loaded[name] = library
        _tag_compile_cache(folder.name)
        return time.perf_counter() - start


def builds_paid() -> dict[str, float]:
    """Seconds this process spent building each extension, or waiting while another process
    built it: a one-time cost, apart from loading (what every later process pays)."""
    return dict(_builds_paid)


def _tag_compile_cache(build: str) -> None:
    """Put this build's name into torch.compile's cache key. Inductor's graph cache names a
    custom op but not its schema, so code compiled against an older build of these ops (one
    argument fewer) would be loaded from the cache and fail; the tag gives each build its own
    key."""
    tag = torch.compiler.config.cache_key_tag
    if build not in tag.split():
        torch.compiler.config.cache_key_tag = f"{tag} {build}".strip()


def _build(folder: Path, sources: Sequence[Path], headers: Sequence[Path]) -> None:
    # No stamp: whatever is here is from a build that died part way (a truncated .so would look
    # up to date to ninja), so start clean. The lock file stays: it is what we hold.
    for entry in folder.iterdir():
        if entry.name != LOCK_FILE:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    cflags, ldflags = build_flags()
    cpp_extension.load(
        name=folder.name,
        sources=[str(p) for p in sources],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        extra_include_paths=sorted({str(p.parent) for p in headers}),
        build_directory=str(folder),
        is_python_module=False,
    )

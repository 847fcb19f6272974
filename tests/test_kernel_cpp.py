"""Tests for the hand-written C++ RMSNorm CPU operator (fusionlab::rms_norm_cpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_streams, rounding_tol, streamed_shape, strided_views

from fusionlab.kernels.rmsnorm import cpu_cpp

_UNAVAILABLE = cpu_cpp.unavailable_reason()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"{_UNAVAILABLE}")

EPS = 1e-6
OP_NAME = "fusionlab::rms_norm_cpu"
TOL = rounding_tol(atol=1e-6)


_LOAD_AND_SAY = (
    "import os, torch\n"
    "from fusionlab.kernels import cpp_build\n"
    "from fusionlab.kernels.rmsnorm import cpu_cpp\n"
    "print(os.getpid(), cpu_cpp.load_extension(), ','.join(cpp_build.builds_paid()) or '-')\n"
    "print(*(p for p in torch.ops.loaded_libraries if 'rmsnorm_cpu_' in p))\n"
)


# A sweep's trial setup in a new process: the build it pays is reported apart from setup_ms.
_GATE_AND_SAY = (
    "import os, torch\n"
    "from fusionlab.cell import Cell\n"
    "from fusionlab.measure.trial import build_and_gate\n"
    "cell = Cell('rmsnorm', 'cpu', 'this-cpu', (4, 96), 'float32')\n"
    "m, setup_ms, _, _ = build_and_gate(cell, 'cpp', {'rows_per_task': 1, 'store': 'plain'}, 0)\n"
    "print(os.getpid(), setup_ms / 1e3, ','.join(m.builds_s) or '-', sum(m.builds_s.values()))\n"
    "print(*(p for p in torch.ops.loaded_libraries if 'rmsnorm_cpu_' in p))\n"
)


def _load_in_subprocess(cache: Path, code: str = _LOAD_AND_SAY) -> tuple[int, float, Path, str]:
    """A new process loads the extension with `cache` as its cache: (pid, seconds, library, the
    builds it paid for, comma-separated, or "-")."""
    env = {**os.environ, "FUSIONLAB_CACHE_DIR": str(cache)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    first, library = result.stdout.splitlines()
    pid, seconds, paid, *_ = first.split()
    return int(pid), float(seconds), Path(library), paid


def _builds(cache: Path) -> list[list[str]]:
    return [line.split("\t") for line in (cache / "builds.log").read_text().splitlines()]


@pytest.fixture(scope="session")
def fresh_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory the extension was built into from nothing, by a process of its own
    (this one may have loaded the extension already, from another test file's cache), as a
    sweep's first trial builds it: the build is reported, and not in the trial's setup time."""
    cache = tmp_path_factory.mktemp("fusionlab_cache")
    pid, setup_s, library, paid = _load_in_subprocess(cache, _GATE_AND_SAY)
    (name, by, build_s), = _builds(cache)
    assert (name, int(by)) == (library.parent.name, pid) and library.is_relative_to(cache)
    assert paid == "rmsnorm_cpu", "the build was not counted as a build (see builds_paid)"
    assert setup_s < 0.5 * float(build_s), "the trial's setup time still holds the build"
    return cache


@pytest.fixture(scope="session", autouse=True)
def extension_loaded(fresh_cache: Path) -> None:
    """This process runs the extension from the fresh cache, unless it loaded it already (the
    same sources and flags: the cache key is their hash)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSIONLAB_CACHE_DIR", str(fresh_cache))
        cpu_cpp.load_extension()


def make(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, weight


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def check(x: torch.Tensor, weight: torch.Tensor, rows_per_task: int = 4) -> None:
    y = cpu_cpp.rms_norm_cpp(x, weight, EPS, rows_per_task)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.double(), reference(x, weight), **TOL[x.dtype])


SHAPES = [(1, 4096), (1, 1), (5, 7), (3, 1000), (2, 4097), (3, 5, 96), (37, 130)]


@pytest.mark.parametrize("rows_per_task", cpu_cpp.ROWS_PER_TASK_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, dtype, rows_per_task):
    check(*make(shape, dtype), rows_per_task)


@pytest.mark.parametrize("shape", [(2, 4097), (3, 5, 96)], ids=["2x4097", "3x5x96"])
def test_float16(shape):
    check(*make(shape, torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_output_streaming_path(dtype):
    x, weight = make(streamed_shape(dtype), dtype, seed=1)
    assert_streams(lambda: cpu_cpp.rms_norm_cpp(x, weight, EPS, 16), x, reference(x, weight),
                   TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_large_output_plain_store_path(dtype):
    # Over glibc's 32 MiB mmap cap every output is a fresh mapping: written with plain stores.
    rows = (33 << 20) // (4096 * torch.empty((), dtype=dtype).element_size())
    check(*make((rows, 4096), dtype, seed=4), rows_per_task=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    base, _ = make((6, 8, 130), dtype, seed=2)
    for name, x in strided_views(base).items():
        assert not x.is_contiguous(), name
        check(x, make(x.shape, dtype, seed=3)[1])


def test_weight_dtype_is_converted():
    x, weight = make((4, 300), torch.bfloat16)
    check(x, weight.float())


def test_empty_input():
    x, weight = make((0, 64), torch.float32)
    assert cpu_cpp.rms_norm_cpp(x, weight, EPS, 1).shape == (0, 64)


@pytest.mark.parametrize(
    ("x_shape", "weight", "eps", "rows_per_task", "match"),
    [
        ((4, 64), torch.ones(63), EPS, 1, "weight must be 1-D of size 64"),
        ((4, 64), torch.ones(1, 64), EPS, 1, "weight must be 1-D"),
        ((4, 64), torch.ones(64), -1.0, 1, "eps must be >= 0"),
        ((4, 64), torch.ones(64), EPS, 0, "rows_per_task must be >= 1"),
        ((4, 64), torch.ones(64, dtype=torch.float64), EPS, 1, "dtypes must be"),
    ],
)
def test_rejects_bad_arguments(x_shape, weight, eps, rows_per_task, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_cpp.rms_norm_cpp(torch.randn(x_shape), weight, eps, rows_per_task)


def test_profiler_sees_one_op_record_per_call():
    x, weight = make((64, 512), torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            cpu_cpp.rms_norm_cpp(x, weight, EPS, 4)
    assert [event.name for event in prof.events()] == [OP_NAME] * 3


def test_load_is_once_per_process():
    assert cpu_cpp.load_extension() == 0.0


def test_missing_compiler_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    reason = cpu_cpp.unavailable_reason()
    assert reason is not None and "no-such-c++-compiler" in reason


def test_second_process_loads_from_cache(fresh_cache: Path):
    (built,) = _builds(fresh_cache)
    library = fresh_cache / "cpp" / built[0] / f"{built[0]}.so"
    mtime = library.stat().st_mtime_ns
    _, seconds, loaded, paid = _load_in_subprocess(fresh_cache)
    assert loaded == library and seconds > 0.0
    assert paid == "-", "loading a cached build was counted as a build"
    assert _builds(fresh_cache) == [built], "a second process built the extension again"
    assert library.stat().st_mtime_ns == mtime, "the cached library was rebuilt"

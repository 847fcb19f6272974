"""Helpers several test files share: quick timing settings, SQLite storage URLs, the C++ kernels'
tolerances and strided inputs, and the Triton kernels' covering (shape, tunables) cases.
Imported as `helpers` (tests/ is on sys.path)."""

from __future__ import annotations

import itertools
import math
import os
import resource
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import optuna
import pytest
import torch

from fusionlab.kernels import cpp_build
from fusionlab.measure.timing import TimingSettings
from fusionlab.search import claims
from fusionlab.search import results_store as store
from fusionlab.search.storage import open_storage

QUICK_TIMING = TimingSettings(warmup_s=0.005, budget_s=0.02, min_samples=3, max_samples=10)
"""Enough samples to rank variants, as fast as a sweep test can go."""
GATE_TIMING = TimingSettings(warmup_s=0.005, budget_s=0.03, min_samples=8, max_samples=30)
"""At least 8 samples: the gate's rules read the spread of the samples."""
TRIAL_TIMING = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=5, max_samples=20)
"""One trial's timing, measured and checked in the test process."""


def sqlite_url(path: Path | str) -> str:
    """The storage URL of a SQLite file at `path`."""
    return f"sqlite:///{path}"


def finished_trials(url: str) -> Counter[tuple[str, str]]:
    """(study, configuration) -> how many finished (measured) trials it has in the storage at
    `url`; the cells' re-measurements aside."""
    storage = open_storage(url, must_exist=True)
    counts: Counter[tuple[str, str]] = Counter()
    for name in optuna.get_all_study_names(storage):
        study = optuna.load_study(study_name=name, storage=storage)
        for trial in study.get_trials(deepcopy=False, states=(
                optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)):
            key = trial.user_attrs.get(claims.CONFIG)
            if key is not None and not store.is_verdict_key(key):
                counts[(name, key)] += 1
    return counts


def run_in_scalar_build(ops: tuple[str, ...], code: str, timeout_s: float) -> None:
    """Build the C++ extensions of `ops` with no vector flags, one process each and all at
    once, then run `code` (from the repository root) in that build: it must print `ok`."""
    tests = str(Path(__file__).parent)  # `code` imports test modules, which import helpers
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH", "")]))
    env = {**os.environ, cpp_build.ISA_ENV: "scalar", "PYTHONPATH": path}
    builders = [
        subprocess.Popen(
            [sys.executable, "-c",
             f"from fusionlab.kernels.{name} import cpu_cpp; cpu_cpp.load_extension()"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name in ops
    ]
    for builder in builders:
        _, err = builder.communicate(timeout=900)
        assert builder.returncode == 0, err[-2000:]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def rounding_tol(atol: float) -> dict[torch.dtype, dict[str, float]]:
    """assert_close tolerances of a kernel that rounds its fp32 result once: a unit roundoff of
    the output type (2^-8 bf16, 2^-11 fp16) plus fp32 accumulation error (under 1e-5)."""
    units = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}
    return {dtype: {"rtol": unit + 1e-5, "atol": atol} for dtype, unit in units.items()}


def strided_views(base: torch.Tensor, expanded: bool = True) -> dict[str, torch.Tensor]:
    """Non-contiguous views of a (6, 8, 130) `base`, one per way a C++ kernel reads rows; the
    expanded one (row stride 0) only where the kernel does not write its input."""
    views = {
        "transposed": base[0].t(),  # last-dim stride != 1: copied
        "column slice": base[..., 3:103],  # uniform row stride, read (or written) in place
        "row step": base[:, ::2],
        "permuted": base.permute(1, 0, 2),  # rows not at a uniform stride: copied
    }
    if expanded:
        views["expanded"] = base[0, :1].expand(5, 130)
    return views


def assert_cpp_contract(cpu_cpp: ModuleType) -> None:
    """A C++ kernel module takes each of its rows_per_task values and no other, offers streaming
    stores only where they can take effect (big enough, rows of whole 64-byte lines), and has
    its extension loaded already."""
    rows_per_task = cpu_cpp.TUNABLES["rows_per_task"]
    assert all(cpu_cpp.param_error((2, 64), rows_per_task=r) is None for r in rows_per_task)
    assert cpu_cpp.param_error((2, 64), rows_per_task=0) is not None
    assert cpu_cpp.param_error((2048, 4096), rows_per_task=1, store="stream") is None
    assert "smaller outputs" in cpu_cpp.param_error((2, 64), rows_per_task=1, store="stream")
    assert "multiple of 32" in cpu_cpp.param_error((8192, 100), rows_per_task=1, store="stream")
    assert cpu_cpp.load_extension() == 0.0


# Awkward shapes (1-D, 1x1, odd hidden, 3-D) and hidden sizes of one and more SIMD blocks.
CPP_SHAPES = [(1, 4096), (4096,), (1, 1), (5, 7), (3, 1000), (2, 5000), (3, 5, 96), (37, 130)]
Test = TypeVar("Test", bound=Callable[..., None])


def over_cpp_cases(rows_per_task: tuple[int, ...],
                   widest: tuple[int, ...]) -> Callable[[Test], Test]:
    """Parametrizes a kernel test over each of CPP_SHAPES and `widest` x (float32, bfloat16) x
    rows_per_task."""
    marks = [  # in the order decorators stacked top to bottom apply: ids read shape-dtype-rows
        pytest.mark.parametrize("shape", [*CPP_SHAPES, widest],
                                ids=lambda shape: "x".join(map(str, shape))),
        pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16]),
        pytest.mark.parametrize("rows_per_task", rows_per_task),
    ]

    def parametrized(test: Test) -> Test:
        for mark in marks:
            test = mark(test)
        return test
    return parametrized


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def streamed_shape(dtype: torch.dtype) -> tuple[int, int]:
    """Rows of 2048 that make an 8 MiB tensor of `dtype`: big enough to be streamed."""
    return (8 << 20) // (2048 * torch.empty((), dtype=dtype).element_size()), 2048


def _check_outputs(result: Outputs, like: torch.Tensor, expected: tuple[torch.Tensor, ...],
                   tolerance: dict[str, float]) -> None:
    outputs = result if isinstance(result, tuple) else (result,)
    for got, want in zip(outputs, expected, strict=True):
        assert got.dtype == like.dtype and got.shape == like.shape
        torch.testing.assert_close(got.double(), want, **tolerance)


def assert_streams(call: Callable[[], Outputs], like: torch.Tensor, expected: Outputs,
                   tolerance: dict[str, float], calls: int = 6) -> None:
    """Outputs of 8 MiB and up are written with non-temporal stores when their pages are already
    mapped and with plain stores when they are fresh. An early call may get fresh pages; once
    malloc reuses freed blocks, a call faults under half of its outputs' pages. Every call's
    outputs (shaped and typed `like`) must match `expected`."""
    wants = expected if isinstance(expected, tuple) else (expected,)
    pages = len(wants) * like.nbytes // resource.getpagesize()
    faults = []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = call()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        _check_outputs(result, like, wants, tolerance)
        del result  # freed before the next call, so malloc can hand its blocks back
    assert min(faults) < pages // 2, f"no call reused mapped outputs: {faults} faults of {pages}"


ParamError = Callable[..., str | None]
Case = tuple[tuple[int, ...], dict[str, int]]

# Awkward shapes (1 row, odd and non-power-of-two hidden, 3-D, ragged last program), the default
# hidden sizes, and one row per block_size value up to 16384.
TRITON_SHAPES = [
    (1, 1), (33, 1), (2, 2), (3, 3), (3, 7), (70, 7), (2, 9), (2, 17), (2, 3, 48), (33, 128),
    (4, 256), (2, 300), (1, 1000), (5, 1000), (2, 2000), (2, 4096), (1, 5000), (1, 8192),
    (1, 10000),
]


def valid_configs(tunables: dict[str, tuple[int, ...]], param_error: ParamError,
                  shape: tuple[int, ...]) -> list[dict[str, int]]:
    """Every combination of `tunables` that `param_error` accepts at `shape`."""
    names = tuple(tunables)
    points = (dict(zip(names, v, strict=True)) for v in itertools.product(*tunables.values()))
    return [p for p in points if param_error(shape, **p) is None]


def _interpreter_cost(case: Case) -> int:
    """The Triton interpreter pays per program and per tile element."""
    shape, cfg = case
    programs = math.ceil(math.prod(shape[:-1]) / cfg["rows_per_program"])
    return programs * (1000 + cfg["rows_per_program"] * cfg["block_size"])


def covering_cases(tunables: dict[str, tuple[int, ...]], param_error: ParamError) -> list[Case]:
    """The cheapest (shape, config) for every tunable value, plus the cheapest per shape of
    TRITON_SHAPES."""
    pool = [(shape, cfg) for shape in TRITON_SHAPES
            for cfg in valid_configs(tunables, param_error, shape)]
    chosen = [min((c for c in pool if c[0] == shape), key=_interpreter_cost)
              for shape in TRITON_SHAPES]
    for name, values in tunables.items():
        for value in values:
            chosen.append(min((c for c in pool if c[1][name] == value), key=_interpreter_cost))
    unique = {(shape, tuple(cfg.values())): (shape, cfg) for shape, cfg in chosen}
    return list(unique.values())

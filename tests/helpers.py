"""Helpers several test files share: quick timing settings, SQLite storage URLs and the Triton
kernels' covering (shape, tunables) cases. Imported as `helpers` (tests/ is on sys.path)."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fusionlab.kernels import cpp_build
from fusionlab.measure.timing import TimingSettings

QUICK_TIMING = TimingSettings(warmup_s=0.005, budget_s=0.02, min_samples=3, max_samples=10)
"""Enough samples to rank variants, as fast as a sweep test can go."""
GATE_TIMING = TimingSettings(warmup_s=0.005, budget_s=0.03, min_samples=8, max_samples=30)
"""At least 8 samples: the gate's rules read the spread of the samples."""
TRIAL_TIMING = TimingSettings(warmup_s=0.01, budget_s=0.05, min_samples=5, max_samples=20)
"""One trial's timing, measured and checked in the test process."""


def sqlite_url(path: Path | str) -> str:
    """The storage URL of a SQLite file at `path`."""
    return f"sqlite:///{path}"


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

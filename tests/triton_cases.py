"""What the Triton kernel tests share: the float64 tolerance check, the non-contiguous views of a
(10, 200) tensor, the default-hidden tile config, the check that the covering cases use every
tunable value, and reference_tests, the tests a kernel module gets from those."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import covering_cases

TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
VIEWS = [
    pytest.param(lambda t: t[:, :100], id="column-slice"),  # row stride 200, last stride 1
    pytest.param(lambda t: t[::2, :100], id="every-other-row"),
    pytest.param(lambda t: t[:, ::2], id="strided-last-dim"),
    pytest.param(lambda t: t[:, :100].reshape(2, 5, 100), id="3d-of-slice"),
    pytest.param(lambda t: t[:, :100].t().contiguous().t(), id="transposed"),
]


def assert_close_to(actual: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """`actual` is within the dtype's relative-plus-absolute tolerance of the float64 `ref`."""
    tol = TOLERANCES[dtype]
    assert ((actual.double() - ref).abs() <= tol + tol * ref.abs()).all()


def assert_tunables_covered(tunables: dict[str, Iterable[Any]],
                            cases: list[tuple[Any, dict[str, Any]]]) -> None:
    """Each value of each tunable appears in some (shape, cfg) case."""
    for name, values in tunables.items():
        assert {cfg[name] for _, cfg in cases} == set(values), name


def default_hidden_cfg(rows: int, threads: int) -> dict[str, int]:
    """The config of the default hidden size 4096: one 4096-wide block."""
    return {"block_size": 4096, "rows_per_program": rows, "threads_per_row": threads}


def reference_tests(check: Callable[..., Any], make_inputs: Callable[..., tuple],
                    kernel: ModuleType) -> tuple[Callable[..., None], ...]:
    """The float64-reference, tunable-coverage and default-hidden-tile tests of a Triton kernel
    module whose `check(*make_inputs(shape, dtype, seed=...), cfg)` checks one call against
    float64, over the covering cases of its TUNABLES."""
    tunables = kernel.TUNABLES
    cases = covering_cases(tunables, kernel.param_error)

    @DTYPES
    @pytest.mark.parametrize(("shape", "cfg"), cases, ids=str)
    def test_matches_float64_reference(shape, cfg, dtype):
        check(*make_inputs(shape, dtype), cfg)

    def test_every_tunable_value_is_exercised():
        assert_tunables_covered(tunables, cases)

    @pytest.mark.parametrize(("rows", "threads"), [(2, 64), (1, 256), (4, 128)])
    def test_default_hidden_tiles(rows, threads):
        check(*make_inputs((7, 4096), torch.bfloat16, seed=9), default_hidden_cfg(rows, threads))

    return (test_matches_float64_reference, test_every_tunable_value_is_exercised,
            test_default_hidden_tiles)

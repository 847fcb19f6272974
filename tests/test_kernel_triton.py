"""Triton RMSNorm kernel, run on CPU tensors through the Triton interpreter."""

import os

# Triton reads this when kernels are decorated, so it must be set before the kernel module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from helpers import covering_cases, valid_configs
from triton_cases import DTYPES, VIEWS, assert_close_to, assert_tunables_covered, default_hidden_cfg

from fusionlab.kernels.rmsnorm.triton_kernel import (
    TUNABLES,
    param_error,
    rms_norm_triton,
    unavailable_reason,
)

EPS = 1e-6
CASES = covering_cases(TUNABLES, param_error)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight


def check(x: torch.Tensor, weight: torch.Tensor, cfg: dict[str, int]) -> None:
    y = rms_norm_triton(x, weight, EPS, **cfg)
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    ref = reference(x, weight, EPS)
    assert_close_to(y, ref, x.dtype)


@DTYPES
@pytest.mark.parametrize(("shape", "cfg"), CASES, ids=str)
def test_matches_float64_reference(shape, cfg, dtype):
    x, weight = make_inputs(shape, dtype)
    check(x, weight, cfg)


def test_every_tunable_value_is_exercised():
    assert_tunables_covered(TUNABLES, CASES)


@pytest.mark.parametrize(
    ("rows", "threads"),
    [pytest.param(2, 64, id="quack"), pytest.param(1, 256, id="liger"), (4, 128)],
)
def test_default_hidden_tiles(rows, threads):
    x, weight = make_inputs((7, 4096), torch.bfloat16, seed=9)
    check(x, weight, default_hidden_cfg(rows, threads))


@pytest.mark.parametrize(
    "cfg",
    [{"block_size": 128, "rows_per_program": 1, "threads_per_row": 32},
     {"block_size": 128, "rows_per_program": 4, "threads_per_row": 16}],
    ids=str,
)
@pytest.mark.parametrize("make_view", VIEWS)
def test_non_contiguous_input(make_view, cfg):
    base, _ = make_inputs((10, 200), torch.float32, seed=1)
    x = make_view(base)
    assert not x.is_contiguous()
    _, weight = make_inputs((100,), torch.float32, seed=2)
    before = base.clone()
    check(x, weight, cfg)
    assert torch.equal(base, before)


@pytest.mark.parametrize(("rows", "threads"), [(1, 32), (2, 16), (8, 8)])
def test_3d_slice_of_wider_tensor(rows, threads):
    base, _ = make_inputs((2, 3, 96), torch.bfloat16, seed=3)
    _, weight = make_inputs((48,), torch.bfloat16, seed=4)
    cfg = {"block_size": 64, "rows_per_program": rows, "threads_per_row": threads}
    check(base[..., :48], weight, cfg)


@pytest.mark.parametrize("rows", [1, 8])
def test_bfloat16_output_is_rounded_once(rows):
    # One rounding of fp32 math stays within 1 bf16 ulp of the exact result whatever the rounding
    # mode (the interpreter truncates, GPUs round to nearest); rounding x * rstd first does not.
    x, weight = make_inputs((16, 128), torch.bfloat16, seed=8)
    cfg = {"block_size": 128, "rows_per_program": rows, "threads_per_row": 32}
    y = rms_norm_triton(x, weight, EPS, **cfg)
    ref = reference(x, weight, EPS)
    _, exponent = torch.frexp(ref)
    ulp = torch.ldexp(torch.ones_like(ref), exponent - 8)  # bf16 keeps 8 significant bits
    assert ((y.double() - ref).abs() / ulp).max().item() < 1.01


def test_float32_weight_with_bfloat16_input():
    x, _ = make_inputs((6, 40), torch.bfloat16, seed=5)
    _, weight = make_inputs((40,), torch.float32, seed=6)
    check(x, weight, {"block_size": 64, "rows_per_program": 1, "threads_per_row": 32})
    check(x, weight, {"block_size": 64, "rows_per_program": 4, "threads_per_row": 16})


def test_zero_row_gives_zeros_not_nan():
    x, weight = make_inputs((4, 24), torch.float32, seed=7)
    x[2] = 0
    for rows in (1, 4):
        cfg = {"block_size": 32, "rows_per_program": rows, "threads_per_row": 32 // rows}
        y = rms_norm_triton(x, weight, EPS, **cfg)
        assert torch.equal(y[2], torch.zeros(24))
        check(x, weight, cfg)


def test_empty_input():
    x, weight = make_inputs((0, 64), torch.float32)
    y = rms_norm_triton(x, weight, EPS, block_size=64, rows_per_program=1, threads_per_row=32)
    assert y.shape == (0, 64)


def err(shape, block_size, rows_per_program, threads_per_row):
    return param_error(shape, block_size, rows_per_program, threads_per_row)


def test_param_error():
    assert err((2048, 4096), 4096, 2, 64) is None  # Quack at 4096: 2 rows of 64 threads
    assert err((2048, 8192), 8192, 1, 128) is None  # Quack at 8192: 1 row of 128 threads
    assert err((2048, 4096), 4096, 1, 256) is None  # Liger at 4096: 8 warps on one row
    assert err((1, 1), 1, 1, 1) is None  # a tile smaller than a warp when nothing can grow it
    assert err((5, 1000), 1024, 4, 64) is None
    assert "next power of two" in err((5, 1000), 512, 1, 64)  # block smaller than the row
    assert "next power of two" in err((5, 1000), 2048, 1, 64)  # only masked lanes added
    assert "power of two" in err((5, 1000), 1024, 3, 64)
    assert "power of two" in err((5, 1000), 1024, 1, 48)
    assert "idle threads" in err((5, 7), 8, 1, 16)  # more threads than elements
    assert "spill" in err((2048, 8192), 8192, 1, 64)  # 128 values per thread
    assert "spill" in err((2048, 4096), 4096, 8, 64)  # 32768-value tile: > 65536 registers
    assert "exceed" in err((2048, 4096), 4096, 2, 1024)  # 2048 threads per block
    assert "masked" in err((1, 4096), 4096, 2, 64)  # a second row that does not exist
    assert "part-idle" in err((64, 256), 256, 1, 16)  # could use more threads per row
    assert "part-idle" in err((64, 8), 8, 2, 8)  # could pack more rows
    assert err((2, 0), 1, 1, 1) is not None
    assert err((), 1, 1, 1) is not None


@pytest.mark.parametrize("hidden", [1, 2, 7, 100, 1000, 4096, 5120, 8192, 16384])
@pytest.mark.parametrize("rows", [1, 4096])
def test_search_space_covers_hidden(hidden, rows):
    assert valid_configs(TUNABLES, param_error, (rows, hidden))


def test_rows_beyond_16384_are_rejected_with_the_reason():
    assert not valid_configs(TUNABLES, param_error, (1, 16385))
    assert "spill" in err((1, 20000), 32768, 1, 1024)


def test_invalid_params_raise_value_error():
    x, weight = make_inputs((2, 1000), torch.float32)
    with pytest.raises(ValueError, match="1000"):
        rms_norm_triton(x, weight, EPS, block_size=512, rows_per_program=1, threads_per_row=64)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_triton(x, weight, EPS, block_size=1024, rows_per_program=3, threads_per_row=64)
    cfg = {"block_size": 1024, "rows_per_program": 2, "threads_per_row": 64}
    with pytest.raises(ValueError, match="parameter shape"):
        rms_norm_triton(x, weight[:10], EPS, **cfg)


def test_available_under_interpreter():
    assert unavailable_reason("cpu") is None


def run_python(code: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_cpu_unavailable_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from fusionlab.kernels.rmsnorm.triton_kernel import rms_norm_triton, unavailable_reason\n"
        "print(unavailable_reason('cpu'))\n"
        "try:\n"
        "    rms_norm_triton(torch.ones(2, 8), torch.ones(8), 1e-6, block_size=8,\n"
        "                    rows_per_program=2, threads_per_row=8)\n"
        "except RuntimeError as exc:\n"
        "    print('RuntimeError', exc)\n"
    )
    reason, raised = run_python(code, env).splitlines()
    assert "CUDA" in reason
    assert raised.startswith("RuntimeError")


def test_imports_without_triton():
    # A None entry in sys.modules makes `import triton` fail as if it were not installed.
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "from fusionlab.kernels.rmsnorm.triton_kernel import param_error, unavailable_reason\n"
        "from fusionlab.kernels.layernorm import triton_kernel as ln\n"
        "from fusionlab.kernels.add_rmsnorm import triton_kernel as add\n"
        "print(unavailable_reason('cuda'))\n"
        "print(param_error((5, 1000), 1024, 4, 64), ln.param_error((5, 1000), 1024, 4, 64),\n"
        "      add.param_error((5, 1000), 1024, 4, 64), ln.unavailable_reason() is not None)\n"
    )
    reason, errors = run_python(code, dict(os.environ)).splitlines()
    assert "not installed" in reason
    assert errors == "None None None True"

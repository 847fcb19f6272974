"""Triton RMSNorm kernels, run on CPU tensors through the Triton interpreter."""

import os

# Triton reads this when kernels are decorated, so it must be set before the kernel module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from fusionlab.kernels.rmsnorm.triton_kernel import (
    TUNABLES,
    param_error,
    rms_norm_triton,
    unavailable_reason,
)

EPS = 1e-6
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# 1 row, odd and non-power-of-two hidden sizes, 3-D, and row counts leaving a ragged last program.
SHAPES = [(1, 1), (3, 7), (1, 1000), (5, 1000), (2, 3, 48), (33, 128), (4, 256)]


def valid_configs(hidden: int) -> list[tuple[int, int, int]]:
    return [
        cfg
        for cfg in itertools.product(
            TUNABLES["block_size"], TUNABLES["rows_per_program"], TUNABLES["num_warps"]
        )
        if param_error(hidden, *cfg) is None
    ]


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    return x, weight


def check(x, weight, cfg):
    block_size, rows_per_program, num_warps = cfg
    y = rms_norm_triton(
        x,
        weight,
        EPS,
        block_size=block_size,
        rows_per_program=rows_per_program,
        num_warps=num_warps,
    )
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    tol = TOLERANCES[x.dtype]
    torch.testing.assert_close(y.double(), reference(x, weight, EPS), rtol=tol, atol=tol)


CASES = [(shape, cfg) for shape in SHAPES for cfg in valid_configs(shape[-1])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("shape", "cfg"), CASES, ids=str)
def test_matches_float64_reference(shape, cfg, dtype):
    x, weight = make_inputs(shape, dtype)
    check(x, weight, cfg)


def test_every_rows_per_program_is_exercised():
    exercised = {cfg[1] for _, cfg in CASES}
    assert exercised == set(TUNABLES["rows_per_program"])


@pytest.mark.parametrize("cfg", [(128, 1, 2), (128, 4, 4)], ids=str)
@pytest.mark.parametrize(
    "make_view",
    [
        pytest.param(lambda t: t[:, :100], id="column-slice"),  # row stride 200, last stride 1
        pytest.param(lambda t: t[::2, :100], id="every-other-row"),
        pytest.param(lambda t: t[:, ::2], id="strided-last-dim"),
        pytest.param(lambda t: t[:, :100].reshape(2, 5, 100), id="3d-of-slice"),
        pytest.param(lambda t: t[:, :100].t().contiguous().t(), id="transposed"),
    ],
)
def test_non_contiguous_input(make_view, cfg):
    base, _ = make_inputs((10, 200), torch.float32, seed=1)
    x = make_view(base)
    assert not x.is_contiguous()
    weight = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(2))
    before = base.clone()
    check(x, weight, cfg)
    assert torch.equal(base, before)


def test_3d_slice_of_wider_tensor():
    base, _ = make_inputs((2, 3, 96), torch.bfloat16, seed=3)
    x = base[..., :48]
    weight = torch.randn(48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for cfg in [(64, 1, 1), (64, 2, 2), (64, 8, 4)]:
        check(x, weight, cfg)


@pytest.mark.parametrize("cfg", [(128, 1, 2), (128, 8, 4)], ids=str)
def test_bfloat16_output_is_rounded_once(cfg):
    # One rounding of fp32 math stays within 1 bf16 ulp of the exact result whatever the rounding
    # mode (the interpreter truncates, GPUs round to nearest); rounding x * rstd first does not.
    x, weight = make_inputs((16, 128), torch.bfloat16, seed=8)
    y = rms_norm_triton(
        x, weight, EPS, block_size=cfg[0], rows_per_program=cfg[1], num_warps=cfg[2]
    )
    ref = reference(x, weight, EPS)
    _, exponent = torch.frexp(ref)
    ulp = torch.ldexp(torch.ones_like(ref), exponent - 8)  # bf16 keeps 8 significant bits
    assert ((y.double() - ref).abs() / ulp).max().item() < 1.01


def test_float32_weight_with_bfloat16_input():
    x, _ = make_inputs((6, 40), torch.bfloat16, seed=5)
    weight = torch.randn(40, generator=torch.Generator().manual_seed(6))
    check(x, weight, (64, 1, 1))
    check(x, weight, (64, 4, 2))


def test_zero_row_gives_zeros_not_nan():
    x, weight = make_inputs((4, 24), torch.float32, seed=7)
    x[2] = 0
    for cfg in [(32, 1, 1), (32, 4, 1)]:
        y = rms_norm_triton(
            x, weight, EPS, block_size=cfg[0], rows_per_program=cfg[1], num_warps=cfg[2]
        )
        assert torch.equal(y[2], torch.zeros(24))
        check(x, weight, cfg)


def test_param_error():
    assert param_error(1000, 1024, 1, 4) is None
    assert param_error(48, 64, 16, 4) is None
    assert "hidden" in param_error(1000, 512, 1, 4)  # block smaller than the row
    assert param_error(1000, 2048, 1, 4) is not None  # only masked lanes added
    assert param_error(1000, 1000, 1, 4) is not None  # not a power of two
    assert param_error(1000, 1024, 3, 4) is not None
    assert param_error(1000, 1024, 1, 3) is not None
    assert param_error(4096, 4096, 2, 8) is not None  # packing rows that are already long
    assert param_error(7, 8, 1, 2) is not None  # 8 elements cannot feed 64 threads
    assert param_error(16384, 16384, 1, 2) is not None  # 256 values per thread would spill
    assert param_error(0, 1, 1, 1) is not None


@pytest.mark.parametrize("hidden", [1, 2, 7, 100, 1000, 4096, 5120, 8192, 16384, 32768])
def test_search_space_covers_hidden(hidden):
    assert valid_configs(hidden)


def test_invalid_params_raise_value_error():
    x, weight = make_inputs((2, 1000), torch.float32)
    with pytest.raises(ValueError, match="1000"):
        rms_norm_triton(x, weight, EPS, block_size=512, rows_per_program=1, num_warps=4)
    with pytest.raises(ValueError):
        rms_norm_triton(x, weight, EPS, block_size=1024, rows_per_program=3, num_warps=4)
    with pytest.raises(ValueError):
        rms_norm_triton(x, weight[:10], EPS, block_size=1024, rows_per_program=1, num_warps=4)


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
        "                    rows_per_program=1, num_warps=1)\n"
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
        "print(unavailable_reason('cuda'))\n"
        "print(param_error(1000, 1024, 1, 4))\n"
    )
    reason, error = run_python(code, dict(os.environ)).splitlines()
    assert "not installed" in reason
    assert error == "None"

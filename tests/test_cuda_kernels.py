"""The compiled Triton kernels on a real CUDA GPU against float64 references (skipped without one).

The checks run in one subprocess without TRITON_INTERPRET (conftest sets it for this process, and
kernels decorated under it never compile); run `python tests/test_cuda_kernels.py` to see them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda

DEFAULT_SHAPES = {
    "rmsnorm": [(1, 4096), (32, 4096), (512, 4096), (2048, 8192)],
    "layernorm": [(1, 4096), (32, 4096), (512, 4096), (2048, 8192)],
    "add_rmsnorm": [(1, 4096), (128, 4096), (2048, 4096), (2048, 8192)],
    "add_layernorm": [(128, 4096), (2048, 8192)],  # two shapes: the device check has a budget
}
TOLERANCES = {"float32": 1e-4, "bfloat16": 1.6e-2}
# Quack's _for_hopper_fwd and Liger's calculate_settings, as (rows_per_program, threads_per_row).
NAMED = {4096: [(2, 64), (1, 256)], 8192: [(1, 128), (1, 512)]}
# Views: a column slice (row stride 2 * hidden), every other row, a 3-D view of a slice.
VIEWS = ("contiguous", "column-slice", "every-other-row", "3d")
DEVICE = "cuda"


def cases() -> list[tuple[str, tuple[int, ...], str, tuple[int, int], str]]:
    """(op, shape, dtype, (rows_per_program, threads_per_row), view) to check on the GPU."""
    from fusionlab.kernels.rmsnorm.triton_kernel import TUNABLES, param_error

    out = []
    for op, shapes in DEFAULT_SHAPES.items():
        for shape in shapes:
            block = 1 << (shape[-1] - 1).bit_length()
            for rows in TUNABLES["rows_per_program"]:
                for threads in TUNABLES["threads_per_row"]:
                    if param_error(shape, block, rows, threads) is None:
                        out.append((op, shape, "bfloat16", (rows, threads), "contiguous"))
            for cfg in NAMED[shape[-1]]:
                if param_error(shape, block, *cfg) is None:
                    out.append((op, shape, "float32", cfg, "contiguous"))
        for view in VIEWS[1:]:
            out.append((op, (64, 4096), "bfloat16", (2, 64), view))
    out.append(("add_rmsnorm_", (128, 4096), "bfloat16", (2, 64), "contiguous"))
    out.append(("add_rmsnorm_", (64, 4096), "bfloat16", (2, 64), "column-slice"))
    for op in ("rmsnorm_backward", "layernorm_backward"):  # the fused backwards
        for shape in ((32, 4096), (2048, 8192)):
            for dtype in ("bfloat16", "float32"):
                out.append((op, shape, dtype, NAMED[shape[-1]][0], "contiguous"))
    return out


def _backward_case(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                   params: dict[str, int], tol: float) -> float:
    """Worst error of the fused backward's gradients against float64 autograd, relative to each
    gradient's scale (dweight sums over rows); <= 1 passes."""
    from fusionlab.kernels.layernorm import triton_backward as ln_backward
    from fusionlab.kernels.rmsnorm import triton_backward as rms_backward

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    grad = torch.randn(x.shape, generator=gen, device=DEVICE).to(x.dtype)
    tensors = (x, w) if op == "rmsnorm_backward" else (x, w, b)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    wide = [t.detach().double().requires_grad_() for t in tensors]
    if op == "rmsnorm_backward":
        got = torch.autograd.grad(rms_backward.rms_norm_triton_fused_grad(*leaves, 1e-6, **params),
                                  leaves, grad)
        ref = wide[0] * torch.rsqrt(wide[0].pow(2).mean(-1, keepdim=True) + 1e-6) * wide[1]
    else:
        got = torch.autograd.grad(ln_backward.layer_norm_triton_fused_grad(*leaves, 1e-5, **params),
                                  leaves, grad)
        mean = wide[0].mean(-1, keepdim=True)
        var = (wide[0] - mean).pow(2).mean(-1, keepdim=True)
        ref = (wide[0] - mean) * torch.rsqrt(var + 1e-5) * wide[1] + wide[2]
    want = torch.autograd.grad(ref, wide, grad.double())
    worst = 0.0
    for g, w64 in zip(got, want, strict=True):
        assert g.dtype == x.dtype and g.shape == w64.shape
        bound = 2 * tol * (w64.abs().max() + w64.abs())
        worst = max(worst, ((g.double() - w64).abs() / bound).max().item())
    return worst


def _view(t: torch.Tensor, view: str) -> torch.Tensor:
    if view == "column-slice":
        return torch.cat([t, t], dim=-1)[:, : t.shape[-1]]
    if view == "every-other-row":
        return torch.repeat_interleave(t, 2, dim=0)[::2]
    if view == "3d":
        return torch.cat([t, t], dim=-1)[:, : t.shape[-1]].reshape(4, -1, t.shape[-1])
    return t


def _run_case(op, shape, dtype_name, cfg, view) -> float:
    """Worst |error| / (tol + tol * |ref|) of one case; <= 1 passes."""
    from fusionlab.kernels.add_layernorm import triton_kernel as add_ln
    from fusionlab.kernels.add_rmsnorm import triton_kernel as add
    from fusionlab.kernels.layernorm import triton_kernel as ln
    from fusionlab.kernels.rmsnorm import triton_kernel as rms

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=DEVICE)

    hidden = shape[-1]
    x = _view(rand(*shape).to(dtype), view)
    r = _view(rand(*shape).to(dtype), view)
    w = (1 + 0.5 * rand(hidden)).to(dtype)
    b = (0.5 * rand(hidden)).to(dtype)
    params = dict(zip(("rows_per_program", "threads_per_row"), cfg, strict=True))
    params["block_size"] = 1 << (hidden - 1).bit_length()
    x64, r64, w64 = x.double(), r.double(), w.double()

    def rms64(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w64

    def ln64(v):
        mean = v.mean(-1, keepdim=True)
        var = (v - mean).pow(2).mean(-1, keepdim=True)
        return (v - mean) * torch.rsqrt(var + 1e-5) * w64 + b.double()

    if op.endswith("_backward"):
        return _backward_case(op, x, w, b, params, TOLERANCES[dtype_name])
    if op == "rmsnorm":
        pairs = [(rms.rms_norm_triton(x, w, 1e-6, **params), rms64(x64))]
    elif op == "layernorm":
        pairs = [(ln.layer_norm_triton(x, w, b, 1e-5, **params), ln64(x64))]
    elif op == "add_layernorm":
        out, res = add_ln.add_layer_norm_triton(x, r, w, b, 1e-5, **params)
        pairs = [(out, ln64(x64 + r64)), (res, x64 + r64)]
    else:
        fn = add.add_rms_norm_triton_ if op == "add_rmsnorm_" else add.add_rms_norm_triton
        out, res = fn(x, r, w, 1e-6, **params)  # the references were taken before
        if op == "add_rmsnorm_":
            assert out is x and res is r
        pairs = [(out, rms64(x64 + r64)), (res, x64 + r64)]
    tol = TOLERANCES[dtype_name]
    worst = 0.0
    for got, ref in pairs:
        assert got.dtype == dtype and got.shape == ref.shape
        worst = max(worst, ((got.double() - ref).abs() / (tol + tol * ref.abs())).max().item())
    return worst


def run_all() -> list[dict]:
    """Every case on the GPU: its worst error ratio, or the exception it raised."""
    results = []
    for case in cases():
        try:
            results.append({"case": repr(case), "worst": _run_case(*case)})
        except Exception as exc:  # one failing case must not hide the others
            results.append({"case": repr(case), "error": f"{type(exc).__name__}: {exc}"})
    return results


@pytest.fixture(scope="module")
def gpu_results() -> dict[str, dict]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return {r["case"]: r for r in json.loads(done.stdout)}


@pytest.mark.parametrize("case", [repr(c) for c in cases()])
def test_compiled_kernel_matches_float64(gpu_results, case):
    result = gpu_results[case]
    assert "error" not in result, result["error"]
    assert result["worst"] <= 1.0, result


if __name__ == "__main__":
    print(json.dumps(run_all()))

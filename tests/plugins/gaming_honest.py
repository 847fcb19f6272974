"""Honest RMSNorm variants written in unusual ways: the gate must pass every one of them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from fusionlab import register_variant

CPU = ("cpu",)
HONEST = ["honest-fp32-upcast", "honest-out-fresh", "honest-transposed"]
# Honest, but torch 2.13's profiler records no operator of a thread it did not start: the gate
# cannot tell this variant from one that hides its work, and flags it (a known false positive).
INVISIBLE_TO_THE_PROFILER = "honest-thread-pool"


def _reference_like(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@register_variant("rmsnorm", "honest-fp32-upcast", devices=CPU)
def fp32_upcast(device_type: str):
    """Computes in float32 whatever the input dtype, then casts back."""
    return _reference_like


@register_variant("rmsnorm", "honest-out-fresh", devices=CPU)
def out_fresh(device_type: str):
    """Writes with `out=` into memory it allocates on every call."""

    def kernel(x, weight, eps):
        out = torch.empty_like(x)
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
        return torch.mul(x * scale, weight, out=out)

    return kernel


@register_variant("rmsnorm", "honest-transposed", devices=CPU)
def transposed(device_type: str):
    """Computes into a transposed buffer and returns the transposed view of it."""

    def kernel(x, weight, eps):
        buffer = torch.empty(x.shape[::-1], dtype=x.dtype).transpose(0, -1)
        buffer.copy_(_reference_like(x, weight, eps))
        return buffer

    return kernel


@register_variant("rmsnorm", "honest-thread-pool", devices=CPU)
def thread_pool(device_type: str):
    """Splits the rows over its own thread pool and waits for every part before returning."""
    pool = ThreadPoolExecutor(max_workers=2)

    def kernel(x, weight, eps):
        out = torch.empty_like(x)
        rows, flat = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
        half = (rows.shape[0] + 1) // 2
        parts = [(0, half), (half, rows.shape[0])]

        def work(part):
            start, stop = part
            if stop > start:
                flat[start:stop] = _reference_like(rows[start:stop], weight, eps)

        list(pool.map(work, parts))
        return out

    return kernel

"""Honest RMSNorm variants written in unusual ways: the gate must pass every one of them."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch

from fusionlab import register_variant

CPU = ("cpu",)
HONEST = ["honest-fp32-upcast", "honest-out-fresh", "honest-transposed", "honest-in-place",
          "honest-serial-own-rng", "honest-torch-threads"]
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


@register_variant("rmsnorm", "honest-in-place", devices=CPU, inplace={"y": "x"})
def in_place(device_type: str):
    """Writes the answer over its input, as declared."""

    def kernel(x, weight, eps):
        return x.copy_(_reference_like(x, weight, eps))

    return kernel


@register_variant("rmsnorm", "honest-serial-own-rng", devices=CPU)
def serial_own_rng(device_type: str):
    """On one thread (the cell's count restored before it returns), in blocks of rows taken in
    an order drawn from generators of its own (Python's and torch's)."""
    order, generator = random.Random(1234), torch.Generator().manual_seed(7)

    def kernel(x, weight, eps):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rows = x.reshape(-1, x.shape[-1])
            out = torch.empty_like(rows)
            block = max(1, rows.shape[0] // 4)
            starts = list(range(0, rows.shape[0], block))
            order.shuffle(starts)
            torch.rand(1, generator=generator)
            for start in starts:
                out[start:start + block] = _reference_like(rows[start:start + block], weight, eps)
            return out.view(x.shape)
        finally:
            torch.set_num_threads(threads)

    return kernel


@register_variant("rmsnorm", "honest-torch-threads", devices=CPU)
def torch_threads(device_type: str):
    """Row norms from torch.linalg.vector_norm on every thread of torch's intra-op pool."""

    def kernel(x, weight, eps):
        h = x.float()
        norms = torch.linalg.vector_norm(h, dim=-1, keepdim=True) / h.shape[-1] ** 0.5
        return (h * torch.rsqrt(norms * norms + eps) * weight.float()).to(x.dtype)

    return kernel

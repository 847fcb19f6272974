"""Peak memory of one call, in bytes the device's torch allocator handed out beyond what was live
when the call began: activations, gradients, optimizer state created, temporaries.

CPU has no allocator statistics, so the call runs under torch.profiler with profile_memory: every
allocation and free of torch's CPU allocator is an event with its signed size, and the running sum
of those in time order peaks at the answer. Blocks allocated before the call and freed inside it
are not seen by the profiler, so the caller must not free any (set gradients to None before).
Python objects, glibc's own overhead and memory outside torch's allocator are not counted. CUDA
uses the caching allocator's own peak statistics (tensors allocated, not the cache reserved)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(call: Callable[[], object], device: torch.device) -> int:
    """The most bytes live at once during `call` beyond those live when it began."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with _profiler_notices_dropped(), profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as recorded:
        call()
    events = sorted(
        (event.start_ns(), event.nbytes()) for event in recorded.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak


@contextmanager
def _profiler_notices_dropped() -> Iterator[None]:
    """The profiler's start/stop notices kept off stderr (written by C++, so at the descriptor);
    any other line written meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines():
                if line.strip() and not line.startswith(("USDT:", "STAGE:")):
                    print(line, file=sys.stderr)

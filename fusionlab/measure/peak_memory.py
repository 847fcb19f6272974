"""Memory one call uses, in bytes the device's torch allocator handed out beyond what was live
when the call began: the most live at once (activations, gradients, optimizer state created,
temporaries), and what is still live when it returns while its result is held (for a forward that
returns its loss: the tensors autograd saved for backward, the logits and the loss).

CPU has no allocator statistics, so the call runs under torch.profiler with profile_memory: every
allocation and free of torch's CPU allocator is an event with its signed size, and the running sum
of those in time order gives both figures. Blocks allocated before the call and freed inside it
are not seen by the profiler, so the caller must not free any (set gradients to None before).
Python objects, glibc's own overhead and memory outside torch's allocator are not counted. CUDA
uses the caching allocator's own statistics (tensors allocated, not the cache reserved)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class MemoryUse:
    """Bytes beyond those live when the call began."""

    peak: int  # the most live at once during the call
    retained: int  # still live when it returned, its result held


def memory_use(call: Callable[[], object], device: torch.device) -> MemoryUse:
    """The call's peak and retained bytes (its result is dropped after they are read)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = call()
        torch.cuda.synchronize(device)
        use = MemoryUse(torch.cuda.max_memory_allocated(device) - start,
                        torch.cuda.memory_allocated(device) - start)
        del result
        return use
    with _profiler_notices_dropped(), profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as recorded:
        result = call()
    del result
    events = sorted(
        (event.start_ns(), event.nbytes()) for event in recorded.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return MemoryUse(peak, live)


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

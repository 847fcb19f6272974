"""A correct RMSNorm variant that writes the allocator settings of the process that builds it to
$FUSIONLAB_ALLOCATOR_PROBE, so a test can see what the measuring process really started with."""

import os

import torch

from fusionlab import register_variant

_NAMES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")


@register_variant("rmsnorm", "allocator-probe", devices=("cpu",))
def allocator_probe(device_type: str):
    """torch.rms_norm, after noting the allocator variables of this process."""
    seen = " ".join(f"{name}={os.environ.get(name, '-')}" for name in _NAMES)
    with open(os.environ["FUSIONLAB_ALLOCATOR_PROBE"], "a", encoding="utf-8") as probe:
        probe.write(f"{seen}\n")
    return lambda x, weight, eps: torch.rms_norm(x, (x.shape[-1],), weight, eps)

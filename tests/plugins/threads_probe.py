"""A correct RMSNorm variant that writes the thread count it was built with to
$FUSIONLAB_THREADS_PROBE, so a test can see what the measuring process really used."""

import os

import torch

from fusionlab import register_variant


@register_variant("rmsnorm", "threads-probe", devices=("cpu",))
def threads_probe(device_type: str):
    """torch.rms_norm, after noting torch.get_num_threads()."""
    with open(os.environ["FUSIONLAB_THREADS_PROBE"], "a", encoding="utf-8") as probe:
        probe.write(f"{torch.get_num_threads()}\n")
    return lambda x, weight, eps: torch.rms_norm(x, (x.shape[-1],), weight, eps)

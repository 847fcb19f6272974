"""A correct RMSNorm variant that writes the thread count it was built with to
$FUSIONLAB_THREADS_PROBE, so a test can see what the measuring process really used; and, when
$FUSIONLAB_AFFINITY_PROBE is set, every process that loads this plugin (the sweep, each worker,
each measuring process) writes its pid, parent pid and CPU affinity there."""

import os

import torch

from fusionlab import register_variant

if os.environ.get("FUSIONLAB_AFFINITY_PROBE"):
    with open(os.environ["FUSIONLAB_AFFINITY_PROBE"], "a", encoding="utf-8") as _probe:
        _cores = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
        _probe.write(f"{os.getpid()} {os.getppid()} {_cores}\n")


@register_variant("rmsnorm", "threads-probe", devices=("cpu",))
def threads_probe(device_type: str):
    """torch.rms_norm, after noting torch.get_num_threads()."""
    with open(os.environ["FUSIONLAB_THREADS_PROBE"], "a", encoding="utf-8") as probe:
        probe.write(f"{torch.get_num_threads()}\n")
    return lambda x, weight, eps: torch.rms_norm(x, (x.shape[-1],), weight, eps)

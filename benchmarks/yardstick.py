"""Why the copy-bandwidth yardstick moves: each `x.clone()` timed alone, with the page faults it
took (ru_minflt) and the times it was descheduled (ru_nivcsw), under each allocator setting, in a
process of its own per setting (glibc reads its tunables at start).

For each size, per allocator: the median, min and max GB/s over the calls, the faults per call,
the share of calls that were descheduled, and the median GB/s of those that were not. A clone
whose output needs fresh pages pays a fault per 4 KiB page; a descheduled one pays another
process's time slice. The load average is printed at start and end: the machine is shared.

    python benchmarks/yardstick.py [--sizes-mib 16,64] [--calls 60] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from fusionlab.measure import allocator


def _probe(mib: int, calls: int) -> str:
    x = torch.randn(mib << 18)  # mib MiB of fp32
    for _ in range(3):
        x.clone()
    gbps, faults, switched, quiet = [], [], 0, []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        y = x.clone()
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        del y
        rate = 2 * x.nbytes / seconds / 1e9
        gbps.append(rate)
        faults.append(after.ru_minflt - before.ru_minflt)
        if after.ru_nivcsw > before.ru_nivcsw:
            switched += 1
        else:
            quiet.append(rate)
    quiet_gbps = f"{statistics.median(quiet):.1f}" if quiet else "-"
    return (f"{mib} MiB: {statistics.median(gbps):.1f} GB/s (min {min(gbps):.1f}, max "
            f"{max(gbps):.1f}), {statistics.median(faults):.0f} faults/call, {switched}/{calls} "
            f"descheduled, undisturbed median {quiet_gbps} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", default="16,64")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    torch.set_num_threads(args.threads)
    if args.child:
        for mib in sizes:
            print(f"  {args.child}: {_probe(mib, args.calls)}", flush=True)
        return
    print(f"load {os.getloadavg()}, {args.threads} threads")
    for name in allocator.SETTINGS:
        with allocator.applied(name):
            subprocess.run([sys.executable, *sys.argv, "--child", name], check=True,
                           env=dict(os.environ))
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()

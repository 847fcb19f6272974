"""The host allocator state a CPU cell is measured under: set in the measuring worker's
environment before it starts (glibc reads its malloc tunables, torch THP_MEM_ALLOC_ENABLE, once
at process start) and recorded in every cell.

* `fixed` (default): glibc's mmap threshold pinned at 128 MiB and its trim threshold at 512 MiB,
  so an allocation is served the same way whatever the process allocated and freed before (glibc
  otherwise raises its mmap threshold after the first large free, and a cell near 32 MiB per
  tensor could flip between runs: README, "The device's own limit").
* `default`: glibc's own dynamic thresholds, as a process that sets nothing gets.
* `thp`: glibc's default and torch's transparent huge pages for allocations of 2 MiB and more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from fusionlab.errors import UserError

DEFAULT = "fixed"
_FIXED = {"MALLOC_MMAP_THRESHOLD_": str(128 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}
_NAMES = (*_FIXED, "THP_MEM_ALLOC_ENABLE")
SETTINGS: dict[str, dict[str, str]] = {
    "fixed": _FIXED,
    "default": {},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
}


def check(name: str) -> str:
    """The allocator setting, or a UserError naming the choices."""
    if name not in SETTINGS:
        raise UserError(f"--allocator must be one of {', '.join(SETTINGS)} (got {name!r})")
    return name


@contextmanager
def applied(name: str) -> Iterator[None]:
    """os.environ holds exactly this setting's variables (others of ours removed) while a
    worker process is started inside the block; restored after."""
    saved = {key: os.environ.get(key) for key in _NAMES}
    for key in _NAMES:
        os.environ.pop(key, None)
    os.environ.update(SETTINGS[name] if name else {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

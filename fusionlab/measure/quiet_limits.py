"""The last copy limits this machine measured while it was quiet, kept on disk between runs.

A copy limit measured while the machine was busy is no yardstick (the copy ran slow, so
everything looks fast beside it). When it stays busy after being measured again, the gate
judges against the last quiet limit of the same size class stored here instead of judging
nothing. The file is keyed by the toolchain that measured it (device type, hardware name,
torch version: `key`), so a limit from another machine or another torch never judges:
`$FUSIONLAB_CACHE_DIR` (default ~/.cache/fusionlab)/copy-limits/<key>.json. A store that cannot
be read or written is treated as empty: the verdict then says nothing was there to judge by.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from fusionlab.devices import Device
from fusionlab.measure.disturbance import BUSY_NOTE
from fusionlab.measure.limits import LimitsCache
from fusionlab.records import CopyLimits


def key(device: Device) -> str:
    """The toolchain a stored limit belongs to: device type, hardware name, torch version."""
    text = f"{device.type}|{device.hardware_name()}|{torch.__version__}"
    return f"{device.type}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def path(device: Device) -> Path:
    from fusionlab.kernels.cpp_build import cache_dir  # imports cpp_extension: only when used

    return cache_dir() / "copy-limits" / f"{key(device)}.json"


def _load(file: Path) -> dict[str, CopyLimits]:
    try:
        data = json.loads(file.read_text())
        return {name: CopyLimits.from_dict(entry) for name, entry in data.items()}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def last_quiet(device: Device, dtype: torch.dtype, nbytes: int, cold: bool) -> CopyLimits | None:
    """The last quiet limit stored for this toolchain and size class, or None."""
    return _load(path(device)).get(LimitsCache.key(device.type, dtype, nbytes, cold))


def remember(device: Device, limit: CopyLimits) -> None:
    """Store a limit measured while the machine was quiet (a busy one is never stored); the
    file is replaced whole, so a reader never sees half of it."""
    if BUSY_NOTE in limit.note:
        return
    file = path(device)
    entries = _load(file)
    entries[LimitsCache.key(limit.device_type, limit.dtype, limit.nbytes, limit.cold)] = limit
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as out:
            json.dump({name: entry.to_dict() for name, entry in entries.items()}, out)
        os.replace(temporary, file)
    except OSError:
        Path(temporary).unlink(missing_ok=True)

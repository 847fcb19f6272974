"""The toolchain a result was measured with: library versions and the kernels' own sources.

A change to any of them (a new torch or Triton, a Neuron compiler, an edited hand-written
kernel) gives a new toolchain id, so new numbers never mix with old ones.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path

import torch

from fusionlab.devices import Device
from fusionlab.op import OpSpec

_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh")
_BUILTIN_PACKAGE = "fusionlab.kernels"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _source_files(spec: OpSpec) -> list[Path]:
    """The files an op's numbers depend on: its folder (and the shared kernel helpers) for a
    built-in op, else the module that defines the op."""
    module_name = spec.make_inputs.__module__
    origin = getattr(sys.modules.get(module_name), "__file__", None)
    if origin is None:
        return []
    path = Path(origin)
    if not module_name.startswith(_BUILTIN_PACKAGE + "."):
        return [path]
    roots = [Path(folder) for folder in sys.modules[_BUILTIN_PACKAGE].__path__]
    own = [p for p in path.parent.rglob("*") if p.suffix in _SOURCE_SUFFIXES]
    return [*(file for root in roots for file in root.glob("*.py")), *own]


def kernel_sources_hash(spec: OpSpec) -> str:
    """One hash of every source file the op's kernels are built from."""
    digest = hashlib.sha256()
    for file in sorted({p.resolve() for p in _source_files(spec)}):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def toolchain(device: Device, spec: OpSpec) -> dict[str, str]:
    """Versions of torch, fusionlab and the device's software, and the op's source hash."""
    return {
        "torch": torch.__version__,
        "fusionlab": _version("fusionlab"),
        **device.toolchain(),
        "kernels": kernel_sources_hash(spec),
    }


def toolchain_id(versions: dict[str, str]) -> str:
    """A short, stable id of a toolchain, used in study names."""
    return hashlib.sha1(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:10]


def describe_difference(stored: dict[str, str], installed: dict[str, str]) -> str:
    """What changed between two toolchains, e.g. `torch 2.12.0 -> 2.13.0, kernels changed`."""
    changes = []
    for key in sorted(set(stored) | set(installed)):
        old, new = stored.get(key, "-"), installed.get(key, "-")
        if old != new:
            changes.append("kernels changed" if key == "kernels" else f"{key} {old} -> {new}")
    return ", ".join(changes)

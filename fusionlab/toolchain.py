"""The toolchain a result was measured with: library versions and the kernels' own sources.

A change to any of them (a new torch or Triton, a Neuron compiler, an edited hand-written
kernel) gives a new toolchain id, so new numbers never mix with old ones. A built-in op's
sources are its own folder plus every kernel file it imports or #includes, across op folders
(layernorm's C++ includes rmsnorm's cpu_norm_common.h; its Triton kernel imports rmsnorm's
helpers), less the test helpers in TEST_HELPERS.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import torch

from fusionlab.devices import Device
from fusionlab.op import OpSpec

_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh")
# Test helpers the kernels import that change no measured number: kernels/nki_replay.py is a
# NumPy model of the NKI hardware, used to replay the NKI kernels on a CPU in tests.
TEST_HELPERS = frozenset({"nki_replay.py"})
_BUILTIN_PACKAGE = "fusionlab.kernels"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _source_files(spec: OpSpec) -> list[Path]:
    """The files an op's numbers depend on: for a built-in op, its folder and every kernel file
    those import or #include, across op folders; else the module that defines the op."""
    module_name = spec.make_inputs.__module__
    origin = getattr(sys.modules.get(module_name), "__file__", None)
    if origin is None:
        return []
    path = Path(origin)
    if not module_name.startswith(_BUILTIN_PACKAGE + "."):
        return [path]
    roots = [Path(folder) for folder in sys.modules[_BUILTIN_PACKAGE].__path__]
    return op_folder_sources(path.parent, roots)


def op_folder_sources(folder: Path, roots: list[Path]) -> list[Path]:
    """A built-in op folder's sources and what they import or include from the kernel roots."""
    own = [p for p in folder.rglob("*") if p.suffix in _SOURCE_SUFFIXES]
    return sorted(_with_dependencies(own, roots))


def _with_dependencies(files: list[Path], roots: list[Path]) -> set[Path]:
    """The files and, transitively, the kernel modules they import and the headers they include
    (test helpers excepted)."""
    found: set[Path] = set()
    todo = [p.resolve() for p in files]
    while todo:
        file = todo.pop()
        if file in found or file.name in TEST_HELPERS:
            continue
        found.add(file)
        if file.suffix == ".py":
            todo.extend(_imported_kernel_files(file, roots))
        else:
            todo.extend(_included_files(file, roots))
    return found


def _imported_kernel_files(file: Path, roots: list[Path]) -> list[Path]:
    """Files of the fusionlab.kernels modules a Python file imports (anywhere in it)."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    result = []
    for name in names:
        if not name.startswith(_BUILTIN_PACKAGE + "."):
            continue
        parts = name[len(_BUILTIN_PACKAGE) + 1 :].split(".")
        for root in roots:
            module = root.joinpath(*parts)
            for candidate in (module.with_suffix(".py"), module / "__init__.py"):
                if candidate.is_file():
                    result.append(candidate.resolve())
    return result


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _included_files(file: Path, roots: list[Path]) -> list[Path]:
    """Headers a C++/CUDA file includes with quotes: beside it, else in any kernel folder (the
    build puts a shared header's folder on the include path)."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    result = []
    for name in _INCLUDE.findall(text):
        beside = file.parent / name
        if beside.is_file():
            result.append(beside.resolve())
            continue
        result.extend(p.resolve() for root in roots for p in root.rglob(Path(name).name))
    return result


def kernel_sources_hash(spec: OpSpec) -> str:
    """One hash of every source file the op's kernels are built from."""
    return files_hash(_source_files(spec))


def files_hash(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in sorted({p.resolve() for p in files}):
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

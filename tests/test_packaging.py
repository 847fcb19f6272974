"""A wheel built from the tree carries every op folder's modules and C++ sources, found rather
than listed: a new kernels/<op>/ ships without editing pyproject.toml or setup.py."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = (".py", ".cpp", ".h", ".cu")


def test_wheel_holds_every_op_module_and_source(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("fusionlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "fusionlab/kernels/" + str(path.relative_to(ROOT / "kernels"))
        for path in (ROOT / "kernels").rglob("*")
        if path.suffix in SHIPPED and "__pycache__" not in path.parts
    }
    ops = {p.parent.name for p in (ROOT / "kernels").glob("*/spec.py")}
    assert {"rmsnorm", "layernorm", "add_rmsnorm"} <= ops
    assert expected and expected <= names, sorted(expected - names)
    assert "fusionlab/search/runner.py" in names and "fusionlab/measure/trial.py" in names


def test_the_wheel_installed_alone_finds_every_op_folder(tmp_path: Path) -> None:
    """Installed from the wheel (kernels/ and search/ copied inside fusionlab/), every op folder
    registers, and nothing is read from the checkout."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("fusionlab-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], check=True, capture_output=True, timeout=300,
    )
    code = ("import fusionlab, fusionlab.kernels, fusionlab.search.runner;"
            "from fusionlab.registry import op_names;"
            "print(fusionlab.__file__); print(list(fusionlab.kernels.__path__)); print(op_names())")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(site)}, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    module_file, kernel_path, ops = result.stdout.strip().splitlines()
    assert module_file.startswith(str(site)) and str(ROOT) not in kernel_path
    folders = {p.parent.name for p in (ROOT / "kernels").glob("*/spec.py")}
    assert set(eval(ops)) == folders


def test_the_checkout_registers_every_op_folder() -> None:
    """In the checkout (the editable install), every folder with a spec.py is an op."""
    from fusionlab.registry import op_names

    assert set(op_names()) >= {p.parent.name for p in (ROOT / "kernels").glob("*/spec.py")}

"""A wheel built from the tree carries every op folder's modules and C++ sources, found rather
than listed: a new kernels/<op>/ ships without editing pyproject.toml or setup.py."""

from __future__ import annotations

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

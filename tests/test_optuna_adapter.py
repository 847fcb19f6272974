"""Optuna's private API is used in one module, for a pinned range of versions: the pin in
pyproject.toml and the adapter's own check agree, and any other version is refused in one line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import optuna
import pytest

from fusionlab.errors import UserError
from fusionlab.search import optuna_adapter

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_optuna_is_supported_and_others_are_refused() -> None:
    optuna_adapter.check_version(optuna.__version__)
    high = optuna_adapter.SUPPORTED[1]
    for version in ("4.5.0", f"{high[0]}.{high[1]}.0", "6.0.0"):
        with pytest.raises(UserError, match=r"pip install 'optuna>="):
            optuna_adapter.check_version(version)


def test_the_pin_in_pyproject_is_the_adapters_range() -> None:
    (low, high) = optuna_adapter.SUPPORTED
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"optuna([^"]*)"', text)
    assert pin is not None and pin.group(1) == f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"


def test_no_other_module_reaches_into_optuna_privately() -> None:
    """Private Optuna modules are imported by the adapter alone (search/ and fusionlab/)."""
    offenders = []
    for file in [*ROOT.joinpath("search").glob("*.py"), *ROOT.joinpath("fusionlab").rglob("*.py")]:
        if file.name == "optuna_adapter.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "optuna"
            ) and any(part.startswith("_") for part in node.module.split(".")):
                offenders.append(f"{file.name}: {node.module}")
    assert not offenders, offenders

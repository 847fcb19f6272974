"""No import runs up a floor, and no modules import each other in a circle.

Every file under fusionlab/, kernels/ and search/ is parsed with `ast`; every import in it counts,
at module level, inside functions and under TYPE_CHECKING alike. kernels/ and search/ are read as
fusionlab.kernels and fusionlab.search (how fusionlab finds them). A module may import modules on
its own floor or below (docs/layout.md says why each floor sits where it does); importing a
submodule counts as importing that module, not its package's __init__."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("fusionlab", "kernels", "search")

# Lowest floor first: each entry is a module or a package (and everything under it).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("fusionlab._checkout", "fusionlab.errors", "fusionlab.shapes", "fusionlab.schema",
     "fusionlab.numerics", "fusionlab.plausible"),
    ("fusionlab.devices", "fusionlab.op", "fusionlab.cell", "fusionlab.records",
     "fusionlab.results", "fusionlab.registry", "fusionlab.toolchain"),
    ("fusionlab.kernels.common",),
    ("fusionlab.kernels",),
    ("fusionlab.verdict", "fusionlab.winners"),
    ("fusionlab.measure",),
    ("fusionlab.plan",),
    ("fusionlab.search",),
    ("fusionlab.runtime", "fusionlab.api"),
    ("fusionlab.model",),
    ("fusionlab.report", "fusionlab.investigation"),
    ("fusionlab.commands",),
    ("fusionlab.cli", "fusionlab"),
)


def module_name(root: Path, path: Path) -> str:
    """The dotted name a file is imported as (kernels/ and search/ inside fusionlab)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in ("kernels", "search"):
        parts.insert(0, "fusionlab")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_modules(root: Path) -> dict[str, Path]:
    return {module_name(root, path): path
            for folder in SOURCES if (root / folder).is_dir()
            for path in sorted((root / folder).rglob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool,
              modules: dict[str, Path]) -> list[str]:
    """The known modules one import statement loads: `from package import module` names the
    module, `from module import name` the module; relative imports are resolved."""
    if isinstance(node, ast.Import):
        return [_known_prefix(alias.name, modules) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
            else _known_prefix(base, modules) for alias in node.names]


def _known_prefix(dotted: str, modules: dict[str, Path]) -> str:
    """The longest known module that is `dotted` or a package above it ("" if none)."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted


def import_edges(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported fusionlab module: line of the first such import}."""
    modules = read_modules(root)
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        targets = edges.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(node, name, path.name == "__init__.py", modules):
                if target.startswith("fusionlab") and target != name:
                    targets.setdefault(target, node.lineno)
    return edges


def floor_of(module: str) -> int | None:
    """The floor of the longest FLOORS entry that is the module or a package above it."""
    best: tuple[int, int] | None = None
    for index, entries in enumerate(FLOORS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (
                    best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]


def upward_imports(root: Path) -> list[str]:
    """One line per import of a module on a higher floor than the importer's."""
    problems = []
    for name, targets in sorted(import_edges(root).items()):
        for target, line in sorted(targets.items()):
            mine, theirs = floor_of(name), floor_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{name} (floor {mine}) imports {target} (floor {theirs}) at "
                                f"line {line}")
    return problems


def circle(root: Path) -> list[str]:
    """Modules that import each other in a circle ([] when there is none)."""
    sorter = graphlib.TopologicalSorter(
        {name: set(targets) for name, targets in import_edges(root).items()})
    try:
        sorter.prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def test_every_module_has_a_floor() -> None:
    homeless = [name for name in read_modules(ROOT) if floor_of(name) is None]
    assert not homeless, f"add these to FLOORS (and docs/layout.md): {homeless}"


def test_no_import_runs_up_a_floor() -> None:
    assert upward_imports(ROOT) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circle(ROOT) == []


def test_the_imports_read_include_function_level_and_relative_ones() -> None:
    edges = import_edges(ROOT)
    assert "fusionlab.report.html" in edges["fusionlab.commands.report"]  # inside run()
    assert "fusionlab.measure.trial" in edges["fusionlab.search.runner"]
    assert edges["fusionlab.cli"].keys() >= {"fusionlab.commands", "fusionlab.errors"}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


@pytest.mark.parametrize("importer, statement", [
    ("fusionlab/measure/timer.py", "from fusionlab.commands import sweep\n"),
    ("fusionlab/measure/timer.py", "def f():\n    from fusionlab.report.tables import x\n"),
    ("search/store.py", "import fusionlab.model.patch\n"),
    ("fusionlab/verdict.py", "from .plan import SweepPlan\n"),
])
def test_an_upward_import_is_caught(tmp_path: Path, importer: str, statement: str) -> None:
    root = _tree(tmp_path, {
        "fusionlab/__init__.py": "", "fusionlab/errors.py": "", "fusionlab/plan.py": "",
        "fusionlab/verdict.py": "",
        "fusionlab/commands/__init__.py": "", "fusionlab/commands/sweep.py": "",
        "fusionlab/report/__init__.py": "", "fusionlab/report/tables.py": "",
        "fusionlab/measure/__init__.py": "", "fusionlab/model/__init__.py": "",
        "fusionlab/model/patch.py": "", "search/store.py": "", "fusionlab/measure/timer.py": "",
    })
    (root / importer).write_text(statement, encoding="utf-8")
    assert len(upward_imports(root)) == 1
    (root / importer).write_text("from fusionlab.errors import UserError\n", encoding="utf-8")
    assert upward_imports(root) == []


def test_a_circle_on_one_floor_is_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "fusionlab/model/__init__.py": "",
        "fusionlab/model/capture.py": "from fusionlab.model.candidates import find\n",
        "fusionlab/model/candidates.py": "def f():\n    from fusionlab.model import capture\n",
    })
    assert upward_imports(root) == []
    assert set(circle(root)) == {"fusionlab.model.capture", "fusionlab.model.candidates"}

"""The README is for users and links into docs/: every relative link in them resolves inside the
repository (file and, where given, heading), the README stays short, its Python parses, and no
page or module cites an issue tracker that is not in the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {_anchor(heading) for heading in headings}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target for target in LINK.findall(text) if "://" not in target]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(resolved), f"{page.name}: no heading for {target}"


def test_the_readme_links_every_docs_page_and_stays_short() -> None:
    readme = ROOT / "README.md"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(readme)}
    pages = {page.resolve() for page in PAGES[1:]}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
    assert len(readme.read_text().splitlines()) <= 250


def test_the_readme_python_parses() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for block in blocks:
        ast.parse(block)


def test_no_page_or_module_cites_an_issue_number_or_a_path_outside_the_repository() -> None:
    folders = ("fusionlab", "kernels", "search", "tests", "benchmarks", "docs")
    files = [ROOT / "README.md"]
    for folder in folders:
        files += [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.md")]
    cited = re.compile(r"[Ii]ssues? #?\d+|\.\./shared/")
    offenders = [f"{path.relative_to(ROOT)}:{number}"
                 for path in files if path.name != "test_docs.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if cited.search(line)]
    assert not offenders, offenders

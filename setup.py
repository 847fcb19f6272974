"""Packages are found, not listed: a new op folder under kernels/ ships without editing a list.

The three top-level folders install as one package: fusionlab/ as `fusionlab`, kernels/ as
`fusionlab.kernels`, search/ as `fusionlab.search` (package-dir in pyproject.toml). kernels/ and
search/ have no __init__.py (namespace portions), so a checkout's root never shadows real
packages named `kernels` or `search`."""

from setuptools import find_namespace_packages, setup


def _under(package: str, folder: str) -> list[str]:
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    return [package, *(f"{package}.{name}" for name in found)]


setup(
    packages=[
        *_under("fusionlab", "fusionlab"),
        *_under("fusionlab.kernels", "kernels"),
        *_under("fusionlab.search", "search"),
    ]
)

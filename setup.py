"""Packages are found, not listed: a new op folder under kernels/ ships without editing a list.

The three top-level folders install as one package: fusionlab/ as `fusionlab`, kernels/ as
`fusionlab.kernels`, search/ as `fusionlab.search` (package-dir in pyproject.toml)."""

from setuptools import find_packages, setup


def _under(package: str, folder: str) -> list[str]:
    return [package, *(f"{package}.{name}" for name in find_packages(folder))]


setup(
    packages=[
        *_under("fusionlab", "fusionlab"),
        *_under("fusionlab.kernels", "kernels"),
        *_under("fusionlab.search", "search"),
    ]
)

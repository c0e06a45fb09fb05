"""The package list, derived: every package under the folders of ``package-dir``.

pyproject.toml maps three import names onto folders (``multiattn`` -> ``multiattn/``,
``multiattn.backends`` -> ``backends/``, ``multiattn.conformance`` -> ``conformance/``),
which ``[tool.setuptools.packages.find]`` cannot express (it names packages after their
folders). So the packages are found here instead: each mapped package and every package
(a folder with an ``__init__.py``) below its folder, under the mapped name. Everything
else, the mapping included, stays in pyproject.toml.
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # build-system.requires installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent


def mapped_packages() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    found = set()
    for package, folder in package_dir.items():
        if not (ROOT / folder / "__init__.py").is_file():
            raise SystemExit(f"package-dir: {folder}/ (for {package}) has no __init__.py")
        found.add(package)
        found.update(f"{package}.{sub}" for sub in find_packages(str(ROOT / folder)))
    return sorted(found)


setup(packages=mapped_packages())

"""Every package: one version, read from its `__version__` by its pyproject and installed
as its metadata; project URLs; the Apache-2.0 license it declares, as a file; a changelog."""

from __future__ import annotations

import ast
import importlib
import os
from importlib import metadata

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# distribution folder, package, distribution name
PACKAGES = [
    (".", "xgraph", "xgraph"),
    ("adapters/cuda", "xgraph_cuda", "xgraph-cuda"),
    ("adapters/ascend", "xgraph_ascend", "xgraph-ascend"),
    ("tests/dummy_adapter", "xgraph_dummy", "xgraph-dummy"),
]


def pyproject(folder: str) -> dict:
    with open(os.path.join(ROOT, folder, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def version_literals(folder: str, package: str) -> list[str]:
    """The string literals `__version__` is assigned in the package's __init__.py."""
    path = os.path.join(ROOT, folder, package, "__init__.py")
    tree = ast.parse(open(path).read(), path)
    return [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]


@pytest.mark.parametrize("folder,package,dist", PACKAGES, ids=[p for _, p, _ in PACKAGES])
def test_one_version_per_package(folder, package, dist):
    project = pyproject(folder)
    assert "version" not in project["project"], "the version is read from __version__"
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == f"{package}.__version__"
    (literal,) = version_literals(folder, package)
    assert importlib.import_module(package).__version__ == literal
    assert metadata.version(dist) == literal, "installed metadata is stale: reinstall"


@pytest.mark.parametrize("folder,package,dist", PACKAGES, ids=[p for _, p, _ in PACKAGES])
def test_project_urls(folder, package, dist):
    urls = pyproject(folder)["project"]["urls"]
    assert {"Homepage", "Repository"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())


@pytest.mark.parametrize("folder", [".", "adapters/cuda", "adapters/ascend"])
def test_the_declared_license_is_shipped_in_full(folder):
    assert pyproject(folder)["project"]["license"] == {"text": "Apache-2.0"}
    text = open(os.path.join(ROOT, folder, "LICENSE")).read()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 190  # the whole license, not a notice


def test_the_changelog_has_the_current_version():
    import xgraph

    text = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    assert "## [Unreleased]" in text
    assert f"## [{xgraph.__version__}]" in text

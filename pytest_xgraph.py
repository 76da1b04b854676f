"""pytest plugin of xgraph: `--xgraph-backend NAME` picks the backend the conformance suite
(`xgraph.testing`) runs against.

pytest loads this module (the `pytest11` entry point) in every run of every project where
xgraph is installed, so it imports nothing but pytest: xgraph, and torch with it, load only
when a test imports them.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("xgraph")
    group.addoption(
        "--xgraph-backend",
        action="store",
        default=None,
        help="xgraph backend the conformance suite runs against (default: XGRAPH_BACKEND, "
        "else the best available one)",
    )
    group.addoption(
        "--xgraph-capabilities",
        action="store",
        default=None,
        help="capabilities of the backend, declared on top of the conformance class's: "
        "name=yes|no[,...] (virtual_memory, routes_segments, reports_memory, reads_launches, "
        "linear_kernel; xgraph.testing.capabilities)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xgraph_conformance: a test of the xgraph backend contract")

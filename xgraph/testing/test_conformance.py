"""Entry module of `xgraph conformance`: the whole suite against `--xgraph-backend`.

The capabilities are the defaults (what a torch-style device has) lowered by
`--xgraph-capabilities name=no,...` on the command line, and for the core's own CPU
backend by its declaration here (an adapter declares its own in its conformance subclass,
and passes the same on the command line).
"""

from __future__ import annotations

import os

import pytest

from xgraph.testing import Capabilities, ConformanceSuite

# the CPU reference backend: no linear kernel of its own; memfd VMM and /proc readings
# where the host has them (Linux)
CPU_CAPABILITIES = Capabilities(
    virtual_memory=hasattr(os, "memfd_create"),
    routes_segments=hasattr(os, "memfd_create"),
    reports_memory=os.path.exists("/proc/self/smaps_rollup"),
    linear_kernel=False,
)
DECLARED = {"cpu": CPU_CAPABILITIES}


class TestConformance(ConformanceSuite):
    @pytest.fixture
    def declared(self, request: pytest.FixtureRequest, backend) -> Capabilities:  # type: ignore[no-untyped-def, override]
        from xgraph.testing.capabilities import with_option

        base = DECLARED.get(backend.name, Capabilities())
        return with_option(base, request.config.getoption("xgraph_capabilities", default=None))

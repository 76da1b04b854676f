"""The whole conformance suite against the CPU reference backend (the CLI runs it too:
`xgraph conformance --backend cpu`)."""

from xgraph.testing import ConformanceSuite
from xgraph.testing.test_conformance import CPU_CAPABILITIES


class TestCPUConformance(ConformanceSuite):
    backend_name = "cpu"
    capabilities = CPU_CAPABILITIES  # no linear kernel of its own; the rest on Linux

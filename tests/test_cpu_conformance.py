"""The whole conformance suite against the CPU reference backend (the CLI runs it too:
`xgraph conformance --backend cpu`)."""

from xgraph.testing import ConformanceSuite


class TestCPUConformance(ConformanceSuite):
    backend_name = "cpu"

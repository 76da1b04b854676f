"""What a third-party adapter writes to run xgraph's conformance suite: one class, one line."""

from xgraph.testing import ConformanceSuite


class TestDummyConformance(ConformanceSuite):
    backend_name = "dummy"

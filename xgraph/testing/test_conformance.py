"""Entry module of `xgraph conformance`: the whole suite against `--xgraph-backend`."""

from xgraph.testing import ConformanceSuite


class TestConformance(ConformanceSuite):
    pass

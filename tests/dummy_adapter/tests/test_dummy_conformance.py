"""What a third-party adapter writes to run xgraph's conformance suite: one class, naming
the backend and declaring what it lacks of a torch-style device."""

from xgraph.testing import Capabilities, ConformanceSuite


class TestDummyConformance(ConformanceSuite):
    backend_name = "dummy"
    capabilities = Capabilities(linear_kernel=False)  # the rest of a torch-style device

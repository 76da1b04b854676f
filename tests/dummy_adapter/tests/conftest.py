import pytest

from xgraph.plugins import registry


@pytest.fixture(autouse=True)
def _dummy_enabled(monkeypatch):
    """The dummy adapter is off unless XGRAPH_DUMMY_BACKEND=1 (so it never shadows cpu)."""
    monkeypatch.setenv("XGRAPH_DUMMY_BACKEND", "1")
    registry.reset()
    yield
    monkeypatch.delenv("XGRAPH_DUMMY_BACKEND")
    registry.reset()

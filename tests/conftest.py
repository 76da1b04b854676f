import os

import pytest

# Tests pick backends by name; a stray XGRAPH_BACKEND from the shell must not redirect them.
os.environ.pop("XGRAPH_BACKEND", None)


@pytest.fixture
def cpu():
    import xgraph

    return xgraph.get_backend("cpu")

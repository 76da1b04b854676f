import os
import tempfile

import pytest
import torch

# Tests pick backends by name; a stray XGRAPH_BACKEND from the shell must not redirect them.
os.environ.pop("XGRAPH_BACKEND", None)
# Compiled forwards keep their artifacts per machine (xgraph.compile_cache): tests keep theirs
# in a folder of their own, so no run reads another's (a test that needs one names its own).
os.environ.setdefault(
    "XGRAPH_COMPILE_CACHE", tempfile.mkdtemp(prefix="xgraph-compile-cache-tests-")
)


@pytest.fixture
def cpu():
    import xgraph

    return xgraph.get_backend("cpu")


# The reference model's ops are tiny: one intra-op thread is faster than two fighting over
# two cores with everything else a CI machine runs, and its timings stay steady.
torch.set_num_threads(1)

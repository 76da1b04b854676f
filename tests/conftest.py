import os
import tempfile

import pytest
import torch

# Tests pick backends by name; a stray XGRAPH_BACKEND from the shell must not redirect them.
os.environ.pop("XGRAPH_BACKEND", None)
# Compiled forwards keep their artifacts per machine (xgraph.compile_cache): tests keep theirs
# in a folder of their own, so no run reads another's (a test that needs one names its own).
# pytest-xdist's workers inherit the environment of the process that started them: the folder
# that process made is replaced by one of each worker's own.
_made = os.environ.get("XGRAPH_TESTS_COMPILE_CACHE")
if os.environ.get("XGRAPH_COMPILE_CACHE", _made) == _made:
    _made = tempfile.mkdtemp(prefix="xgraph-compile-cache-tests-")
    os.environ["XGRAPH_COMPILE_CACHE"] = os.environ["XGRAPH_TESTS_COMPILE_CACHE"] = _made


@pytest.fixture
def cpu():
    import xgraph

    return xgraph.get_backend("cpu")


# The reference model's ops are tiny: one intra-op thread is faster than two fighting over
# two cores with everything else a CI machine runs, and its timings stay steady.
torch.set_num_threads(1)

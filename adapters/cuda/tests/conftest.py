"""The CUDA backend for the adapter's own tests (skipped where it is not available)."""

import pytest

import xgraph


@pytest.fixture
def backend():  # type: ignore[no-untyped-def]
    try:
        return xgraph.get_backend("cuda")
    except xgraph.BackendUnavailableError as exc:
        pytest.skip(str(exc))

"""A third-party xgraph adapter used by xgraph's own tests.

It is a complete backend (host memory, recorded-op graphs) built from xgraph's public
classes, so it must pass the conformance suite. It reports itself available only when
XGRAPH_DUMMY_BACKEND=1, so installing it does not change which backend others get.
"""

__version__ = "0.0.1"  # the one source: pyproject.toml reads it

from xgraph.hooks import BackendSpec, hookimpl


@hookimpl
def xgraph_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="dummy",
            priority=10,
            backend="xgraph_dummy.backend:DummyBackend",
            probe="xgraph_dummy.backend:probe",
            distribution="xgraph-dummy",
            hidden=True,  # a test adapter: `xgraph info --all` lists it
        )
    ]

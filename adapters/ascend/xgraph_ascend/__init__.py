"""xgraph adapter for Ascend NPUs. Importing it registers the backend and loads neither torch_npu
nor libascendcl; those are imported by the probe (when listing) or the backend (when chosen)."""

from xgraph.plugins import BackendSpec, hookimpl


@hookimpl
def xgraph_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="ascend",
            priority=90,
            backend="xgraph_ascend.backend:AscendBackend",
            probe="xgraph_ascend.probe:availability",
            distribution="xgraph-ascend",
        )
    ]

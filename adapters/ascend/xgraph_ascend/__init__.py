"""xgraph adapter for Ascend NPUs: registration and availability (torch_npu, NPUs present).

Importing it loads neither torch_npu nor libascendcl; the probe does, when backends are
listed. The NPUGraph / aclrt VMM backend itself is not implemented yet, so the probe never
reports the backend available (docs/hardware.md)."""

from xgraph.hooks import BackendSpec, hookimpl


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

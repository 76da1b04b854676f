"""xgraph adapter for Ascend NPUs. Importing it registers two backends and loads neither
torch_npu nor libascendcl:

- `ascend`: ACL graphs (torch_npu NPUGraph), aclrt virtual memory, torch_npu MemPools;
  available where torch_npu imports and an NPU is visible (the probe says why not);
- `ascend-sim`: the same adapter over a simulated ACL runtime on the host; hidden (listed
  only when selected) and never chosen by priority. CI proves the adapter against it.
"""

__version__ = "0.1.0"  # the one source: pyproject.toml reads it

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
        ),
        BackendSpec(
            name="ascend-sim",
            priority=1,
            backend="xgraph_ascend.backend:AscendSimBackend",
            probe="xgraph_ascend.sim:availability",
            distribution="xgraph-ascend",
            hidden=True,  # a simulator: selected by name only
        ),
    ]

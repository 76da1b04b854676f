"""xgraph adapter for NVIDIA GPUs. Importing it registers the backend and loads no CUDA library;
the backend class (`xgraph_cuda.backend`) is imported only when the backend is chosen."""

__version__ = "0.1.0"  # the one source: pyproject.toml reads it

from xgraph.hooks import BackendSpec, hookimpl


@hookimpl
def xgraph_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cuda",
            priority=100,
            backend="xgraph_cuda.backend:CUDABackend",
            probe="xgraph_cuda.probe:availability",
            distribution="xgraph-cuda",
        )
    ]

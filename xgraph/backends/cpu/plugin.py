"""Registers the CPU reference backend; the core registers this module itself."""

from __future__ import annotations

from ...plugins import BackendSpec, hookimpl


@hookimpl
def xgraph_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cpu",
            priority=0,  # lowest: any available accelerator wins by default
            backend="xgraph.backends.cpu.backend:CPUBackend",
            probe="xgraph.backends.cpu.backend:CPUBackend.availability",
            distribution="xgraph",
        )
    ]

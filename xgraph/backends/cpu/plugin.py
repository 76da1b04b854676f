"""Registers the CPU reference backend; the host registers this module like any plugin."""

from __future__ import annotations

from ...hooks import BackendSpec, hookimpl


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

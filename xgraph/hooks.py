"""The plugin interface: hook markers, the hook spec and what a hook returns.

An adapter's registration module imports only this (never the host, never a device
library): it marks an `xgraph_backends` function with `hookimpl` and returns BackendSpecs
holding *strings*, so nothing device-specific is imported until a backend is listed
(probe) or chosen (class).
"""

from __future__ import annotations

from dataclasses import dataclass

import pluggy

PROJECT = "xgraph"
ENTRY_POINT_GROUP = "xgraph.backends"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin registers: a name, a priority and where to find the class and the probe."""

    name: str
    priority: int
    backend: str  # "package.module:Class", imported only when the backend is chosen
    probe: str  # "package.module:function" returning an Availability; must be cheap
    distribution: str | None = None  # for `xgraph info` versions
    hidden: bool = False  # test or simulation backends: listed only when asked for


class BackendHookSpecs:
    """The hooks xgraph calls on its plugins."""

    @hookspec
    def xgraph_backends(self) -> list[BackendSpec]:  # type: ignore[empty-body]
        """Return the backends this plugin provides."""

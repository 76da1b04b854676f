"""Backend discovery: pluggy hookspecs, entry-point loading and backend selection.

An adapter distribution declares an entry point in the group ``xgraph.backends`` pointing
at a module with an ``xgraph_backends`` hookimpl. That hook returns ``BackendSpec`` objects
holding *strings* (the backend class path and the availability probe path): nothing
device-specific is imported until a backend is listed (probe) or chosen (class).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    IncompleteBackendError,
    XGraphError,
)
from .interfaces import Availability, Backend

logger = logging.getLogger("xgraph")

ENTRY_POINT_GROUP = "xgraph.backends"
hookspec = pluggy.HookspecMarker("xgraph")
hookimpl = pluggy.HookimplMarker("xgraph")


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin registers: a name, a priority and where to find the class and the probe."""

    name: str
    priority: int
    backend: str  # "package.module:Class", imported only when the backend is chosen
    probe: str  # "package.module:function" returning an Availability; must be cheap
    distribution: str | None = None  # for `xgraph info` versions


@dataclass
class BackendInfo:
    """A registered backend as `list_backends` reports it."""

    name: str
    priority: int
    available: bool
    reason: str
    versions: dict[str, str] = field(default_factory=dict)
    spec: BackendSpec | None = None
    plugin: str = ""


class BackendHookSpecs:
    @hookspec
    def xgraph_backends(self) -> list[BackendSpec]:  # type: ignore[empty-body]
        """Return the backends this plugin provides."""


def _import_object(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


class Registry:
    """The process-wide plugin manager, the registered specs and the chosen backend objects."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pm: pluggy.PluginManager | None = None
        self._specs: dict[str, tuple[BackendSpec, str]] | None = None
        self._broken: list[BackendInfo] = []
        self._probes: dict[str, Availability] = {}
        self._instances: dict[str, Backend] = {}

    # -- loading ---------------------------------------------------------------------------

    def plugin_manager(self) -> pluggy.PluginManager:
        with self._lock:
            if self._pm is None:
                pm = pluggy.PluginManager("xgraph")
                pm.add_hookspecs(BackendHookSpecs)
                from .backends.cpu import plugin as cpu_plugin

                pm.register(cpu_plugin, name="xgraph.cpu")
                if os.environ.get("XGRAPH_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true"):
                    self._load_entry_points(pm)
                self._pm = pm
            return self._pm

    def _load_entry_points(self, pm: pluggy.PluginManager) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                dist = getattr(getattr(ep, "dist", None), "name", "?")
                logger.warning("xgraph plugin %r (%s) failed to load: %s", ep.name, dist, exc)
                self._broken.append(
                    BackendInfo(
                        ep.name, -1, False, f"plugin failed to import: {exc!r}", plugin=dist
                    )
                )
                continue
            pm.register(plugin, name=ep.name)

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object by hand (tests, embedded adapters)."""
        with self._lock:
            self.plugin_manager().register(plugin, name=name)
            self._specs = None
            self._probes.clear()

    def specs(self) -> dict[str, tuple[BackendSpec, str]]:
        with self._lock:
            if self._specs is None:
                pm = self.plugin_manager()
                specs: dict[str, tuple[BackendSpec, str]] = {}
                for impl in reversed(pm.hook.xgraph_backends.get_hookimpls()):
                    for spec in impl.function() or []:
                        if spec.name in specs:
                            logger.warning(
                                "backend %r registered by both %s and %s; keeping the first",
                                spec.name,
                                specs[spec.name][1],
                                impl.plugin_name,
                            )
                            continue
                        specs[spec.name] = (spec, impl.plugin_name)
                self._specs = specs
            return self._specs

    # -- listing ---------------------------------------------------------------------------

    def probe(self, name: str, refresh: bool = False, check_class: bool = True) -> Availability:
        """The plugin's own probe; with `check_class`, an available backend whose class does
        not load or is incomplete is reported unavailable with that reason."""
        spec, _ = self.specs()[name]
        if refresh or name not in self._probes:
            try:
                avail = _import_object(spec.probe)()
                if not isinstance(avail, Availability):
                    avail = Availability(False, f"probe {spec.probe} returned {avail!r}")
            except Exception as exc:
                avail = Availability(False, f"availability probe {spec.probe} failed: {exc!r}")
            self._probes[name] = avail
        avail = self._probes[name]
        if check_class and avail.available:
            try:
                self._backend_class(spec)
            except XGraphError as exc:
                return Availability(False, str(exc), avail.versions)
        return avail

    def list(self, refresh: bool = False) -> list[BackendInfo]:
        out = []
        for name, (spec, plugin) in self.specs().items():
            avail = self.probe(name, refresh)
            versions = dict(avail.versions)
            if spec.distribution and spec.distribution not in versions:
                try:
                    versions[spec.distribution] = metadata.version(spec.distribution)
                except metadata.PackageNotFoundError:
                    pass
            out.append(
                BackendInfo(
                    name, spec.priority, avail.available, avail.reason, versions, spec, plugin
                )
            )
        out += self._broken
        out.sort(key=lambda b: (-b.priority, b.name))
        return out

    def available_names(self) -> list[str]:
        return [b.name for b in self.list() if b.available]

    # -- selection -------------------------------------------------------------------------

    def _backend_class(self, spec: BackendSpec) -> type[Backend]:
        try:
            cls = _import_object(spec.backend)
        except Exception as exc:
            raise BackendUnavailableError(
                f"Backend {spec.name!r}: importing {spec.backend} failed ({exc!r}). "
                f"Reinstall the adapter that provides it, or pick another backend."
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise IncompleteBackendError(
                f"Backend {spec.name!r}: {spec.backend} is not a subclass of xgraph.Backend. "
                "Adapters subclass xgraph.Backend (see docs/writing-an-adapter.md)."
            )
        cls.check_complete()
        return cls

    def get(self, name: str | None = None) -> Backend:
        with self._lock:
            source = "argument"
            if name is None and os.environ.get("XGRAPH_BACKEND"):
                name, source = os.environ["XGRAPH_BACKEND"].strip(), "XGRAPH_BACKEND"
            if name is None:
                avail = [b for b in self.list() if b.available]
                if not avail:  # cpu is always registered, so this means cpu itself is broken
                    raise BackendUnavailableError(
                        "No xgraph backend is available. Run `xgraph info` to see why."
                    )
                name = avail[0].name
            if name in self._instances:
                return self._instances[name]
            specs = self.specs()
            if name not in specs:
                raise BackendNotFoundError(
                    f"Unknown backend {name!r} (from the {source}). "
                    f"Available: {self.available_names()}; registered: {sorted(specs)}. "
                    f"Set XGRAPH_BACKEND to one of the available names, or install the adapter "
                    f"that provides {name!r} (for example `pip install xgraph-{name}`)."
                )
            spec = specs[name][0]
            avail = self.probe(name, check_class=False)
            if not avail.available:
                raise BackendUnavailableError(
                    f"Backend {name!r} (from the {source}) is not available here: {avail.reason}. "
                    f"Available: {self.available_names()}. Choose one of them, or run "
                    "`xgraph info` for details."
                )
            cls = self._backend_class(spec)  # incomplete adapters fail here, loudly
            backend = cls()
            self._instances[name] = backend
            logger.info("xgraph backend %r selected (%s)", name, source)
            return backend

    def reset(self) -> None:
        """Forget plugins, probes and backend objects (tests; a re-scan of entry points)."""
        with self._lock:
            self._pm = None
            self._specs = None
            self._broken = []
            self._probes.clear()
            self._instances.clear()


registry = Registry()


def get_backend(name: str | Backend | None = None) -> Backend:
    """The backend named by the argument, else by XGRAPH_BACKEND, else the best available one.

    An explicit choice that cannot be honoured raises (never a silent fallback).
    """
    if isinstance(name, Backend):
        return name
    return registry.get(name)


def list_backends(refresh: bool = False) -> list[BackendInfo]:
    """Every registered backend, highest priority first, with availability and reason."""
    return registry.list(refresh)

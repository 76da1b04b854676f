"""Backend discovery and selection: the pluggy host.

Plugins are modules marked with `xgraph.hooks.hookimpl`: the built-in CPU backend's
registration module, registered directly, and every module named by an entry point in the
group ``xgraph.backends``, loaded by pluggy (one entry point at a time, so a broken plugin
is reported instead of hiding the others). The host asks them through the hook
(`pm.hook.xgraph_backends()`), probes a backend when it is listed and imports its class
only when it is chosen.
"""

from __future__ import annotations

import builtins
import importlib
import itertools
import logging
import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from . import safety
from .backends.cpu import plugin as cpu_plugin
from .contract import check_backend_class, check_spec_name
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    IncompleteBackendError,
    XGraphError,
)
from .hooks import ENTRY_POINT_GROUP, PROJECT, BackendHookSpecs, BackendSpec
from .interfaces import Availability, Backend

logger = logging.getLogger("xgraph")


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
        self._specs: dict[str, BackendSpec] | None = None
        self._broken: builtins.list[BackendInfo] = []  # `list` below is a method
        self._probes: dict[str, Availability] = {}
        self._instances: dict[str, Backend] = {}

    # -- loading ---------------------------------------------------------------------------

    def plugin_manager(self) -> pluggy.PluginManager:
        with self._lock:
            if self._pm is None:
                pm = pluggy.PluginManager(PROJECT)
                pm.add_hookspecs(BackendHookSpecs)
                pm.register(cpu_plugin, name="xgraph.cpu")  # built in, a plugin like any other
                if os.environ.get("XGRAPH_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true"):
                    self._load_entry_points(pm)
                self._pm = pm
            return self._pm

    def _load_entry_points(self, pm: pluggy.PluginManager) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the others down
                dist = getattr(getattr(ep, "dist", None), "name", "?")
                logger.warning("xgraph plugin %r (%s) failed to load: %s", ep.name, dist, exc)
                self._broken.append(
                    BackendInfo(
                        ep.name, -1, False, f"plugin failed to import: {exc!r}", plugin=dist
                    )
                )

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object by hand (tests, embedded adapters)."""
        with self._lock:
            self.plugin_manager().register(plugin, name=name)
            self._specs = None
            self._probes.clear()

    def specs(self) -> dict[str, BackendSpec]:
        with self._lock:
            if self._specs is None:
                results = self.plugin_manager().hook.xgraph_backends()
                specs: dict[str, BackendSpec] = {}
                # pluggy answers last-registered first; the first registration of a name wins
                for spec in itertools.chain.from_iterable(reversed(results)):
                    if spec.name in specs:
                        logger.warning(
                            "backend %r is registered twice (by %s and %s); keeping the first",
                            spec.name,
                            specs[spec.name].distribution,
                            spec.distribution,
                        )
                        continue
                    specs[spec.name] = spec
                self._specs = specs
            return self._specs

    # -- listing ---------------------------------------------------------------------------

    def probe(self, name: str, refresh: bool = False, check_class: bool = True) -> Availability:
        """The plugin's own probe; with `check_class`, an available backend whose class does
        not load or is incomplete is reported unavailable with that reason."""
        spec = self.specs()[name]
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

    def list(self, refresh: bool = False, hidden: bool = False) -> builtins.list[BackendInfo]:
        """Registered backends; `hidden` ones (test, simulation) only when asked for, or
        once selected (by name, XGRAPH_BACKEND or an earlier get)."""
        out = []
        selected = {*self._instances, os.environ.get("XGRAPH_BACKEND", "").strip()}
        for name, spec in self.specs().items():
            if spec.hidden and not hidden and name not in selected:
                continue
            avail = self.probe(name, refresh)
            versions = dict(avail.versions)
            if spec.distribution and spec.distribution not in versions:
                try:
                    versions[spec.distribution] = metadata.version(spec.distribution)
                except metadata.PackageNotFoundError:
                    pass
            out.append(
                BackendInfo(
                    name,
                    spec.priority,
                    avail.available,
                    avail.reason,
                    versions,
                    spec,
                    spec.distribution or "",
                )
            )
        out += self._broken
        out.sort(key=lambda b: (-b.priority, b.name))
        return out

    def available_names(self) -> builtins.list[str]:
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
                f"Backend {spec.name!r}: {spec.backend} is not a subclass of "
                "xgraph.adapter.Backend. Adapters subclass it (see docs/writing-an-adapter.md)."
            )
        check_backend_class(cls)
        check_spec_name(cls, spec)
        # frames of the adapter's package are library code: CaptureError names the model line
        package = importlib.import_module(cls.__module__.split(".")[0])
        if getattr(package, "__file__", None):
            safety.register_library_path(os.path.dirname(os.path.abspath(package.__file__)))
        return cls

    def get(self, name: str | None = None) -> Backend:
        with self._lock:
            source = "argument"
            if name is None and os.environ.get("XGRAPH_BACKEND"):
                name, source = os.environ["XGRAPH_BACKEND"].strip(), "XGRAPH_BACKEND"
            if name is None:
                source = "highest priority available"
                # hidden backends (tests, simulators) are only ever chosen by name
                avail = [b for b in self.list() if b.available and not _hidden(b)]
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
            spec = specs[name]
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


def _hidden(info: BackendInfo) -> bool:
    return info.spec is not None and info.spec.hidden


registry = Registry()


def get_backend(name: str | Backend | None = None) -> Backend:
    """The backend named by the argument, else by XGRAPH_BACKEND, else the best available one.

    An explicit choice that cannot be honoured raises (never a silent fallback). Getting a
    backend changes nothing else: its kernels take over the core's ops once it is activated
    (`Backend.activate`; GraphExecutor does it).
    """
    if isinstance(name, Backend):
        return name
    return registry.get(name)


def list_backends(refresh: bool = False, hidden: bool = False) -> list[BackendInfo]:
    """Registered backends, highest priority first, with availability and reason; test and
    simulation backends only with `hidden=True`."""
    return registry.list(refresh, hidden)

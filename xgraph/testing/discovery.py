"""Conformance of discovery and selection."""

from __future__ import annotations

import pytest

import xgraph
from xgraph.adapter import Backend, check_backend_class

from ..plugins import list_backends
from .base import BackendTests
from .capabilities import Capabilities, all_mismatches


class PluginTests(BackendTests):
    """Discovery and selection: listed, selectable by name and by XGRAPH_BACKEND, complete."""

    def test_listed_as_available(self, backend: Backend) -> None:
        info = {b.name: b for b in list_backends()}
        assert backend.name in info
        assert info[backend.name].available, info[backend.name].reason

    def test_selected_by_name_is_one_object(self, backend: Backend) -> None:
        assert xgraph.get_backend(backend.name) is backend
        assert isinstance(backend, Backend)
        check_backend_class(type(backend))

    def test_selected_by_environment(self, backend: Backend, monkeypatch) -> None:
        monkeypatch.setenv("XGRAPH_BACKEND", backend.name)
        assert xgraph.get_backend() is backend

    def test_unknown_name_names_the_available_ones(self, backend: Backend) -> None:
        with pytest.raises(xgraph.BackendNotFoundError) as info:
            xgraph.get_backend("no-such-backend")
        msg = str(info.value)
        assert "'no-such-backend'" in msg and repr(backend.name) in msg and "XGRAPH_BACKEND" in msg

    def test_capabilities_are_declared(self, backend: Backend, declared: Capabilities) -> None:
        """Every capability the class declares holds on the backend (each wrong one named)."""
        wrong = all_mismatches(backend, declared)
        assert not wrong, "\n".join(wrong)

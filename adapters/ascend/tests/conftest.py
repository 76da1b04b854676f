"""Fixtures of the Ascend adapter's tests: fresh simulated NPUs (their books start empty)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from xgraph_ascend.backend import AscendSimBackend
from xgraph_ascend.sim import SimRuntime

# tests pick backends by name; a stray XGRAPH_BACKEND from the shell must not redirect them
os.environ.pop("XGRAPH_BACKEND", None)


@pytest.fixture
def make_sim() -> Callable[..., AscendSimBackend]:
    """A factory of fresh simulated-NPU backends: make_sim(era="context", capacity=...)."""

    def make(**kw: object) -> AscendSimBackend:
        return AscendSimBackend(SimRuntime(**kw))  # type: ignore[arg-type]

    return make


def assert_no_violations(backend: AscendSimBackend) -> None:
    """No rule of the simulated ACL layer or of the simulated torch_npu was broken."""
    rt = backend.runtime
    assert rt.lib.violations == [] and rt.violations == [], (rt.lib.violations, rt.violations)


@pytest.fixture
def sim(make_sim) -> AscendSimBackend:  # type: ignore[no-untyped-def]
    """A fresh owner-era simulated NPU; the test fails if it leaves a rule violation."""
    backend = make_sim()
    yield backend
    assert_no_violations(backend)


@pytest.fixture(params=["owner", "context"])
def era_sim(make_sim, request) -> AscendSimBackend:  # type: ignore[no-untyped-def]
    """A fresh simulated NPU of each torch_npu memory-pool era (torch_npu >= 2.13, <= 2.12);
    the test fails if it leaves a rule violation."""
    backend = make_sim(era=request.param)
    yield backend
    assert_no_violations(backend)

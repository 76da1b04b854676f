"""Declared capabilities: a backend that lacks one it did not declare fails the suite.

The conformance classes take capabilities from their declaration (defaults: what a
torch-style device has), never from the backend (xgraph.testing.capabilities). Here a CPU
backend without a virtual memory, one whose graphs cannot describe their recordings and
one with a linear kernel run the capability tests in a fresh pytest: undeclared, each fails
naming the capability and how to lower it (or, for a lowering the backend contradicts, to
remove it); declared, each passes and the suite checks the documented fallback instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from xgraph.testing import Capabilities
from xgraph.testing.capabilities import parse, with_option

MODULE = """
import pytest
import torch.nn.functional as F

from xgraph.backends.cpu import CPUBackend
from xgraph.backends.cpu.graph import CPUGraph
from xgraph.interfaces import Kernels
from xgraph.testing import Capabilities, ConformanceSuite
from xgraph.testing.test_conformance import CPU_CAPABILITIES
from xgraph_dummy.backend import DummyBackend

DUMMY = Capabilities(linear_kernel=False)


class NoVMM(DummyBackend):  # a torch-style device without VMM: shared-pool memory only
    virtual_memory_class = None


class BlindGraph(CPUGraph):
    def _keep_launches(self):
        return False


class Blind(CPUBackend):
    graph_class = BlindGraph


class WithKernel(CPUBackend):
    def kernels(self):
        return Kernels(linear=lambda x, w: F.linear(x, w))


def suite(backend_class, caps):
    class Suite(ConformanceSuite):
        capabilities = caps

        @pytest.fixture
        def backend(self):
            return backend_class()

    return Suite


TestNoVMMUndeclared = suite(NoVMM, DUMMY)
TestNoVMMDeclared = suite(NoVMM, DUMMY.lowered("virtual_memory"))
TestBlindUndeclared = suite(Blind, CPU_CAPABILITIES)
TestBlindDeclared = suite(Blind, CPU_CAPABILITIES.lowered("reads_launches"))
TestKernelLowered = suite(WithKernel, CPU_CAPABILITIES)
TestKernelDeclared = suite(WithKernel, Capabilities())
"""

# the tests that use each capability, on the classes of that capability only (fast ones)
SELECT = (
    "test_capabilities_are_declared or (NoVMM and (test_granularity or test_bad_sizes)) or "
    "(Blind and test_the_reference_model_passes) or (Kernel and test_activation_installs)"
)


def run(tmp_path, select: str = SELECT, *args: str) -> dict[str, tuple[str, str]]:
    """(outcome, message) of each selected test of MODULE, by class::test."""
    path = tmp_path / "test_capability_suites.py"
    path.write_text(MODULE)
    report = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    cmd += [str(path), "-k", select, f"--junitxml={report}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert report.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    out = {}
    for case in ET.parse(report).iter("testcase"):
        key = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        out[key] = (bad[0].tag, bad[0].get("message", "")) if bad else ("passed", "")
    return out


def outcomes(results, cls: str) -> dict[str, tuple[str, str]]:
    return {k.split("::")[1]: v for k, v in results.items() if k.startswith(cls + "::")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):  # type: ignore[no-untyped-def]
    return run(tmp_path_factory.mktemp("caps"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cls", "name", "direction"),
    [
        ("TestNoVMMUndeclared", "virtual_memory", "virtual_memory=False"),
        ("TestBlindUndeclared", "reads_launches", "reads_launches=False"),
        ("TestKernelLowered", "linear_kernel", "Remove the lowering"),
    ],
)
def test_an_undeclared_lack_fails_naming_the_capability(results, cls, name, direction):
    got = outcomes(results, cls)
    assert got, results
    declared_test = got.pop("test_capabilities_are_declared")
    assert declared_test[0] == "failure" and f"capability {name!r}" in declared_test[1]
    assert direction in declared_test[1], declared_test[1]
    # the tests that use the capability fail too (in their fixture), with the same message
    failed = {t: m for t, (o, m) in got.items() if o != "passed"}
    assert failed and all(f"capability {name!r}" in m for m in failed.values()), got


@pytest.mark.slow
@pytest.mark.parametrize("cls", ["TestNoVMMDeclared", "TestBlindDeclared", "TestKernelDeclared"])
def test_a_declared_lack_passes_and_checks_the_fallback(results, cls):
    got = outcomes(results, cls)
    assert got and all(o == "passed" for o, _ in got.values()), got


def test_the_command_line_declares_on_top_of_the_class():
    """`xgraph conformance ... -- --xgraph-capabilities name=no` (run end to end by the
    ascend-sim CLI tests of the MemoryPoolContext era and the dummy adapter's)."""
    base = Capabilities(linear_kernel=False)
    assert with_option(base, "virtual_memory=no, reads_launches=no") == base.lowered(
        "virtual_memory", "reads_launches"
    )
    assert with_option(base, "linear_kernel=yes") == Capabilities()
    assert with_option(base, None) == base


def test_declarations_are_spelled_out():
    assert parse("virtual_memory=no,linear_kernel=yes") == {
        "virtual_memory": False,
        "linear_kernel": True,
    }
    with pytest.raises(ValueError, match="unknown capability 'vmm'"):
        parse("vmm=no")
    with pytest.raises(ValueError, match="virtual_memory=yes or virtual_memory=no"):
        parse("virtual_memory=maybe")
    with pytest.raises(ValueError, match="unknown capability"):
        Capabilities().lowered("gpu")

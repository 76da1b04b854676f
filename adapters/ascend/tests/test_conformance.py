"""The whole conformance suite against `ascend-sim`: the adapter over the simulated runtime."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from xgraph.testing import Capabilities, ConformanceSuite, RunnerCase

ACL_CALLS = {
    "create": "aclrtMallocPhysical",
    "map": "aclrtMapMem",
    "reserve": "aclrtReserveMemAddress",
}


# what the adapter lacks of a torch-style device: a linear kernel of its own, and in the
# MemoryPoolContext era of torch_npu, pools that take their segments from xgraph
LACKS = ["linear_kernel"]
CONTEXT_ERA_LACKS = [*LACKS, "routes_segments"]


def lacks() -> list[str]:
    context = os.environ.get("XGRAPH_ASCEND_SIM_ERA", "owner") == "context"
    return CONTEXT_ERA_LACKS if context else LACKS


class TestAscendSimConformance(ConformanceSuite):
    backend_name = "ascend-sim"
    capabilities = Capabilities().lowered(*lacks())

    def attention_runners(self, backend):  # type: ignore[no-untyped-def]
        """The opt-in FusedDecodeRunner too, in what the fused op takes (bfloat16, blocks
        of 16)."""
        from xgraph_ascend.attention import FusedDecodeRunner

        fused = RunnerCase(
            "FusedDecodeRunner",
            "decode",
            FusedDecodeRunner,
            {"dtype": torch.bfloat16, "block_size": 16, "num_blocks": 200},
        )
        return [*super().attention_runners(backend), fused]

    @pytest.fixture
    def inject_driver_failure(self, backend):  # type: ignore[no-untyped-def]
        """Fail the simulated libascendcl call itself (out of memory), not its wrapper."""

        @contextlib.contextmanager
        def inject(kind: str, nth: int):  # type: ignore[no-untyped-def]
            backend.runtime.faults.inject(ACL_CALLS[kind], 207001, after=nth - 1)
            try:
                yield
            finally:
                backend.runtime.faults.clear()

        return inject


def _cli_conformance(era: str, *pytest_args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XGRAPH_BACKEND"}
    env["XGRAPH_ASCEND_SIM_ERA"] = era
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xgraph.cli",
            "conformance",
            "--backend",
            "ascend-sim",
            "--",
            "-q",
            "--xgraph-capabilities",
            ",".join(f"{name}=no" for name in (CONTEXT_ERA_LACKS if era == "context" else LACKS)),
            *pytest_args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "backend 'ascend-sim' (cpu)" in proc.stdout
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, tail
    assert "deselected" not in summary and "skipped" not in summary, summary
    return proc.stdout


def test_cli_conformance_passes_for_ascend_sim() -> None:
    """`xgraph conformance --backend ascend-sim` as a user runs it (a fresh process)."""
    assert "MemPoolContext" not in _cli_conformance("owner")  # shared-physical: no fallback


def test_cli_conformance_in_the_memory_pool_context_era() -> None:
    """The older torch_npu era: the whole suite; where it asks for shared-physical memory,
    which this era does not offer, it checks the documented fallback (`routes_segments`),
    whose warning names the era."""
    assert "only under MemPoolContext" in _cli_conformance("context")

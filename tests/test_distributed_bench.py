"""The multi-rank benchmark and the GPU run's script, dry-run on the CPU with gloo.

`adapters/cuda/tools/tp_graphs.py` under torchrun with two processes (every stage: TP decode and
prefill, memory orders, the injected desync, DP + EP MoE), and `xgraph bench distributed`
as a group of one (no torchrun), so both are exercised before any GPU machine runs them.
Each subprocess is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _run(cmd: list[str], tmp_path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env["NCCL_NVLS_ENABLE"] = "1"  # a stray setting: the script must force it off again
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.slow
def test_tp_graphs_script_dry_run_with_two_cpu_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    script = ["adapters/cuda/tools/tp_graphs.py", "--backend", "cpu", "--quick"]
    proc = _run([*cmd, *script], tmp_path, 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.load(open(tmp_path / "tp_graphs.json"))["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["env"] == MULTICAST_OFF
        tp = r["tp tiny"]
        assert all(row["equal"] for row in tp["decode"] + tp["prefill"] if "equal" in row)
        assert all(row["agree_us"] > 0 for row in tp["decode"] if "batch" in row)
        assert all(v["data_vs_largest_alone"] <= 1.05 for v in r["memory"].values())
        assert r["desync"]["error"] == "CollectiveMismatchError" and r["desync"]["next_step_ok"]
        assert r["desync"]["seconds"] < r["desync"]["timeout_s"]
        assert all(row.get("equal", True) for row in r["moe"])
        assert any("equal" not in row for row in r["moe"])  # an idle step on each rank


def test_bench_distributed_as_a_group_of_one(tmp_path):
    out = tmp_path / "dist.json"
    cmd = [sys.executable, "-m", "xgraph.cli", "bench", "distributed", "--backend", "cpu"]
    proc = _run([*cmd, "--sizes", "1,4", "--iters", "5", "--json", str(out)], tmp_path, 240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.load(open(out))
    assert data["world_size"] == 1 and data["mismatches"] == 0
    decode = [r for r in data["ranks"][0]["decode"] if "batch" in r]
    assert [r["batch"] for r in decode] == [1, 4]
    assert all(r["equal"] and r["agree_us"] > 0 and r["tp1_ms"] > 0 for r in decode)
    memory = next(r for r in data["ranks"][0]["decode"] if "memory" in r)["memory"]
    assert any("c10d::allreduce_" in c for c in memory["manifest"])  # a group of one issues them
    assert "agree_us" in proc.stdout


def test_release_group_ends_only_the_group_init_group_made():
    """The bench and the GPU script end the default group they made before the interpreter's
    exit (left to it, gloo's threads can abort the process); a caller's own group stays."""
    import torch.distributed as dist

    from xgraph.bench import distributed as bench

    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    bench.init_group("cpu")  # a group of one, made here
    assert dist.is_initialized()
    bench.release_group()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert bench.init_group("cpu") == (0, 1, 0)
        bench.release_group()
        assert dist.is_initialized()  # the caller's: left to the caller
    finally:
        dist.destroy_process_group()

"""`xgraph bench startup`: seconds from building the model to its first token, in a cold
process (empty caches) and a warm one (the caches the cold one left), split into parts.

Each target runs in two fresh interpreters (`xgraph.bench.startup_run` says what each part
is), one after the other, over one fresh temporary folder holding every cache a process
writes: xgraph's compile cache (XGRAPH_COMPILE_CACHE), Inductor's (TORCHINDUCTOR_CACHE_DIR)
and Triton's (TRITON_CACHE_DIR). The cold process starts with them empty; the warm one finds
what the cold one wrote, as a second process on the same machine does. Targets:

- reference: the reference model over its eager forward, decode full graphs at `--sizes`
  (default vLLM's 51 up to 512 on accelerators) and piecewise graphs at SGLang-style sizes
  (`--piecewise-max`, default 2048: 42 sizes), both over one shared-physical graph memory;
- hf (registered by the transformers integration): transformers' Qwen3 of the `--model`
  shape through `GraphModel(compile=True)`, decode and piecewise graphs at the same decode
  sizes; skipped without transformers.

Both read their weights from one checkpoint the bench writes before the processes (seeded
random weights of the `--model` shape as a safetensors folder, xgraph.models.checkpoint;
`weights` in the JSON), as an engine reads its checkpoint: drawing them in each process
would time the host's random number generator instead (6.5 s of the reference's 0.6B
shape on an H200's host). The folder is read from the page cache, as on a machine that
has read it before; without safetensors each process draws the weights.

The JSON: `weights` (the checkpoint: written or not, its bytes), `capture` (the reference's
graphs and seconds with kernels warm, in the warm process, and per graph), `cold` and `warm`
(`seconds` and `parts` of the hf target where it ran, else the reference; every target's
under `targets`), `memory_prediction` (the reference's graph memory predicted before its KV
cache against the reading after every bucket is captured, cold process), `tokens_equal`
(each target's first-step tokens, cold against warm) and `commit`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..buckets import sglang_piecewise_sizes, vllm_capture_sizes
from ..interfaces import Backend
from . import startup_targets
from .report import Checkpoint, note, table
from .startup_run import MARKER, WEIGHTS_ENV, dtype_of

CACHE_ENV = {
    "XGRAPH_COMPILE_CACHE": "xgraph-compile",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
}


def defaults(accel: bool) -> tuple[list[int], list[int]]:
    """Decode and piecewise sizes: the Qwen3-0.6B run on accelerators, small on the CPU."""
    if accel:
        return vllm_capture_sizes(512), sglang_piecewise_sizes(2048)
    return vllm_capture_sizes(16), sglang_piecewise_sizes(32)


def _commit() -> str:
    env = os.environ.get("XGRAPH_COMMIT")
    if env:
        return env
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _weights(backend: Backend, model: str, folder: str) -> dict[str, Any]:
    """The model's seeded random weights written to `folder` as a safetensors checkpoint, in
    the dtype the processes run (xgraph.models.checkpoint): every process then reads them as
    an engine reads its checkpoint. Without safetensors, each process draws them."""
    from ..models.checkpoint import write_checkpoint

    dtype = dtype_of(backend)
    try:
        nbytes = write_checkpoint(model, folder, dtype)
    except ImportError as exc:
        return {"checkpoint": False, "why": f"{type(exc).__name__}: {exc}"}
    return {"checkpoint": True, "bytes": nbytes, "dtype": str(dtype)}


def _process(
    target: str, argv: list[str], caches: str, timeout: float, weights: str | None = None
) -> dict[str, Any]:
    """One fresh interpreter of `target` over the caches in `caches` (and the checkpoint in
    `weights`): its JSON line. It runs through the command line, which imports the
    integrations and so registers their targets."""
    env = {**os.environ, **{k: os.path.join(caches, v) for k, v in CACHE_ENV.items()}}
    env.pop(WEIGHTS_ENV, None)
    if weights is not None:
        env[WEIGHTS_ENV] = weights
    t0 = time.time()
    cmd = [sys.executable, "-m", "xgraph.cli", "bench", "startup", "--process", target, *argv]
    proc = subprocess.run(
        [*cmd, "--t0", repr(t0)], env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"error": f"exit {proc.returncode}: {tail.strip()}"}
    out = json.loads(lines[-1][len(MARKER) :])
    out["process_seconds"] = time.time() - t0
    return out


def _argv(backend: Backend, model: str, decode: list[int], pieces: list[int]) -> list[str]:
    return [
        "--backend",
        backend.name,
        "--model",
        model,
        "--sizes",
        ",".join(map(str, decode)),
        "--pieces",
        ",".join(map(str, pieces)),
    ]


def _memory(run: dict[str, Any]) -> dict[str, Any]:
    """A process's graph memory three ways: the plan's prediction, the per-capture reading
    (pool plus executables metered around each capture) and the device's own reading from
    before the plan to after the captures (`device_graph_bytes`, which also holds what the
    driver kept from the plan's captures and gave the real ones); `plan_held_bytes`: what
    the device still held once the plan's captures were closed."""
    readings = run.get("readings") or {}
    before, after = readings.get("before_plan"), readings.get("after_plan")
    p, m, d = run.get("predicted_bytes"), run.get("measured_bytes"), run.get("device_graph_bytes")
    return {
        "predicted_bytes": p,
        "measured_bytes": m,
        "rel_err": abs(p - m) / m if p is not None and m else None,
        "device_graph_bytes": d,
        "rel_err_device": abs(p - d) / d if p is not None and d else None,
        "plan_held_bytes": None if before is None or after is None else after - before,
    }


def _headline(data: dict[str, Any]) -> None:
    """The issue's fields from the targets' processes."""
    targets = data["targets"]
    ran = [n for n, t in targets.items() if "skipped" not in t.get("cold", {})]
    main = targets["hf" if "hf" in ran else ran[0]] if ran else {}  # hf: the target
    for phase in ("cold", "warm"):
        run = main.get(phase, {})
        data[phase] = {
            "seconds": run.get("seconds"),
            "xgraph_seconds": run.get("xgraph_seconds"),
            "parts": run.get("parts"),
        }
    ref = targets.get("reference", {})
    warm, cold = ref.get("warm", {}), ref.get("cold", {})
    seconds = (warm.get("parts") or {}).get("capture")
    graphs = warm.get("graphs")
    data["capture"] = {
        "graphs": graphs,
        "seconds": seconds,
        "per_graph_s": seconds / graphs if seconds and graphs else None,
        "warmup_s": (warm.get("parts") or {}).get("warmup"),
        "parts": warm.get("capture_parts"),  # host seconds: warm-ups, recordings, replays
        "cold_seconds": (cold.get("parts") or {}).get("capture"),
    }
    data["memory_prediction"] = _memory(cold)
    data["memory"] = {n: _memory(t.get("cold", {})) for n, t in targets.items()}
    data["tokens_equal"] = {
        name: t.get("cold", {}).get("tokens") is not None
        and t.get("cold", {}).get("tokens") == t.get("warm", {}).get("tokens")
        for name, t in targets.items()
        if "skipped" not in t.get("cold", {})
    }
    data["mismatches"] = [name for name, ok in data["tokens_equal"].items() if not ok]


def run(
    backend: Backend,
    model: str,
    decode: list[int] | None = None,
    pieces: list[int] | None = None,
    targets: tuple[str, ...] | None = None,
    timeout: float = 600.0,
    checkpoint: Checkpoint | None = None,
) -> dict[str, Any]:
    """Cold then warm process of each target (see the module docstring)."""
    accel = backend.device.type != "cpu"
    d_def, p_def = defaults(accel)
    decode, pieces = decode or d_def, pieces or p_def
    data: dict[str, Any] = {
        "backend": backend.name,
        "model": model,
        "decode_sizes": decode,
        "piecewise_sizes": pieces,
        "commit": _commit(),
        "targets": {},
    }
    argv = _argv(backend, model, decode, pieces)
    with tempfile.TemporaryDirectory(prefix="xgraph-startup-weights-") as folder:
        note(f"bench startup: {model}'s checkpoint")
        data["weights"] = _weights(backend, model, folder)
        weights = folder if data["weights"]["checkpoint"] else None
        for target in targets or startup_targets():
            _target(data, target, argv, timeout, weights, checkpoint)
    _headline(data)
    return data


def _target(
    data: dict[str, Any],
    target: str,
    argv: list[str],
    timeout: float,
    weights: str | None,
    checkpoint: Checkpoint | None,
) -> None:
    """A target's cold then warm process over one fresh folder of caches."""
    with tempfile.TemporaryDirectory(prefix="xgraph-startup-") as caches:
        for phase in ("cold", "warm"):
            note(f"bench startup: {target}, {phase} process")
            got = _process(target, argv, caches, timeout, weights)
            data["targets"].setdefault(target, {})[phase] = got
            _headline(data)
            if checkpoint is not None:
                checkpoint(data)


# the table's part columns (a target without one leaves it empty)
PARTS = ("start", "import", "weights", "profile", "load", "compile", "plan", "warmup", "capture")


def summarize(data: dict[str, Any]) -> str:
    rows = []
    for name, t in data["targets"].items():
        for phase in ("cold", "warm"):
            r = t.get(phase, {})
            parts = r.get("parts") or {}
            row = {"target": name, "process": phase, "seconds": r.get("seconds")}
            row["xgraph"] = r.get("xgraph_seconds")
            row.update({k: parts.get(k) for k in PARTS})
            row["first_step"] = parts.get("first_step")
            row["graphs"] = r.get("graphs")
            row["error"] = (r.get("error") or r.get("skipped") or "")[:80]
            rows.append(row)
    cols = ["target", "process", "seconds", "xgraph", *PARTS]
    text = table(rows, [*cols, "first_step", "graphs", "error"])
    memory = [{"target": n, **m} for n, m in (data.get("memory") or {}).items()]
    if memory:
        text += "\n\ngraph memory (cold process), bytes:\n" + table(memory, list(memory[0]))
    mp, cap = data.get("memory_prediction") or {}, data.get("capture") or {}
    return (
        f"{text}\n\ncapture (reference, warm process): {cap.get('graphs')} graphs in "
        f"{cap.get('seconds')} s; graph memory predicted {mp.get('predicted_bytes')} B, "
        f"measured {mp.get('measured_bytes')} B (rel_err {mp.get('rel_err')}), by the device "
        f"{mp.get('device_graph_bytes')} B (rel_err {mp.get('rel_err_device')}); tokens equal "
        f"cold vs warm: {data.get('tokens_equal')}"
    )

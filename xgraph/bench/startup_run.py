"""One process of `xgraph bench startup`: from building the model to its first token.

    xgraph bench startup --process reference --t0 TIME --backend cuda --model qwen3-0.6b

xgraph.bench.startup runs this in a fresh interpreter through the command line (which
imports the integrations, so their registered targets are there), once with empty caches
and once with the caches the first one left (the folders come in the environment). It
prints one line, MARKER then JSON: the seconds of each part, the graphs, the graph memory
predicted before the KV cache against the reading once every bucket is captured, and the
tokens of the first step, which the two processes must agree on. `start` is the
interpreter, the imports and the command line, from `--t0`.

The bench's own target, `reference` (xgraph/models/qwen3.py over its eager forward):
`weights` (the model's checkpoint read, over a placeholder cache: the parent writes the
seeded random weights as a safetensors folder before the processes, `WEIGHTS_ENV` names it;
drawn in the process where the parent could not write one), `profile` (an engine's profile
run: the largest step of each kind eagerly, over placeholder executors), `plan` (their
`predict_graph_memory`, before the KV cache), `kv_cache` (the cache and the executors over
it), `warmup` (every size run eagerly: the kernels' own compilation and loading, reported
apart; each as its capture's warm-up, which the capture then skips), `capture` (every size
captured, kernels warm; `capture_parts`: its host seconds in warm-ups, recordings and
replays), `first_step` (a prefill of two prompts and its greedy tokens). The transformers
integration registers `hf` (xgraph/integrations/transformers/bench_startup.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from .readings import driver_reading, settle

MARKER = "XGRAPH_STARTUP "
WEIGHTS_ENV = "XGRAPH_STARTUP_WEIGHTS"  # the checkpoint folder the parent wrote, if any
BLOCK = 16
NOT_XGRAPH = ("start", "import", "weights")  # a process's parts that are not xgraph's work
CONTEXT = 64  # decode layout: tokens per sequence (captures touch the dummy block only)
PIECEWISE_SEQS = 16


class Clock:
    """Seconds of each part, each ending with the device's queue drained; and the device's
    memory in use at named points between parts (`read`), less what work that is not graph
    memory allocated or freed in between (`apart`)."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.parts = backend, {}
        self.readings: dict[str, int | None] = {}
        self.apart_bytes: int | None = 0

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        self.backend.synchronize()
        t0 = time.perf_counter()
        out = fn()
        self.backend.synchronize()
        self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0
        return out

    def read(self, name: str) -> None:
        """The device's memory in use now, settled (queue drained, cached blocks returned),
        between parts: the seconds it takes count in none of them. None where the backend
        has no driver's reading (the CPU's is the whole process's resident size)."""
        self.readings[name] = self._settled()

    def _settled(self) -> int | None:
        return settle(self.backend) if driver_reading(self.backend) else None

    def apart(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (the KV cache, executors' buffers: not graph memory) and keep what the
        device's reading moved by out of `device_graph_bytes`."""
        before = self._settled()
        out = fn()
        after = self._settled()
        if before is None or after is None or self.apart_bytes is None:
            self.apart_bytes = None
        else:
            self.apart_bytes += after - before
        return out

    def device_graph_bytes(self) -> int | None:
        """What the device lost from before the plan to after the captures by its own
        reading, less the work kept `apart`: the graphs' memory including whatever the
        driver kept from the plan's captures for later ones (the per-capture measure cannot
        see that); None without readings."""
        before, after = self.readings.get("before_plan"), self.readings.get("after_capture")
        if before is None or after is None or self.apart_bytes is None:
            return None
        return after - before - self.apart_bytes


def dtype_of(backend: Any) -> Any:
    """The dtype every start-up process runs in, and the bench's checkpoint is written in:
    float32 on the CPU backend, bf16 on accelerators."""
    import torch

    return torch.float32 if backend.device.type == "cpu" else torch.bfloat16


def checkpoint() -> str | None:
    """The checkpoint folder the parent wrote for this process, None: draw the weights."""
    return os.environ.get(WEIGHTS_ENV) or None


def prompts(vocab: int, lens: list[int]) -> list[list[int]]:
    import random

    rng = random.Random(11)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


# -- the reference model -------------------------------------------------------------------


def _reference_executors(model: Any, backend: Any, decode: list[int], pieces: list[int]) -> list:
    from ..memory import GraphMemory
    from ..models import Workload

    memory = GraphMemory(backend, "shared-physical")
    layouts = (
        (Workload(model, -(-CONTEXT // BLOCK), max(decode)), decode, "full"),
        (Workload(model, -(-max(pieces) // BLOCK), PIECEWISE_SEQS), pieces, "piecewise"),
    )
    return [
        w.executor(
            model.forward_logits,
            backend=backend,
            buckets=sizes,
            memory=memory,
            mode=kind,
            name=f"startup-{kind}",
            on_capture_error="raise",
        )
        for w, sizes, kind in layouts
    ]


def _close(executors: list) -> None:
    memory = executors[0].memory
    for ex in executors:
        ex.close()
    memory.close()


def _kv_cache(model: Any, backend: Any, decode: list[int], pieces: list[int]) -> None:
    """The real cache: every decode sequence's context and the largest prefill, in blocks."""
    from ..paging import PagedKVCache

    c, dtype = model.config, next(model.parameters()).dtype
    blocks = max(decode) * -(-CONTEXT // BLOCK) + -(-max(pieces) // BLOCK) * PIECEWISE_SEQS
    model.kv_cache = PagedKVCache(
        c.num_layers, c.num_kv_heads, c.head_dim, blocks, BLOCK, dtype, backend.device
    )


def _reference_first_step(model: Any, pw: Any, top: int) -> list[list[int]]:
    """Two prompts filling the largest piecewise bucket, prefilled from position 0 in
    consecutive blocks; each position's greedy token (the last: the first generated one)."""
    import torch

    from ..metadata import AttentionInputs

    asked = prompts(model.config.vocab_size, [top // 4 + 1, top // 2 + 3])
    ids, pos, slots, rows, at = [], [], [], [], 0
    for p in asked:
        need = -(-len(p) // BLOCK)
        rows.append(list(range(at, at + need)))
        ids += p
        pos += list(range(len(p)))
        slots += list(range(at * BLOCK, at * BLOCK + len(p)))
        at += need
    lens = [len(p) for p in asked]
    attn = AttentionInputs(lens, lens, rows, torch.tensor(slots, dtype=torch.int64))
    logits = pw(input_ids=torch.tensor(ids), positions=torch.tensor(pos), attn=attn)
    tokens = logits.argmax(-1).tolist()
    return [tokens[sum(lens[:i]) : sum(lens[: i + 1])] for i in range(len(lens))]


def _capture_all(full: Any, pw: Any) -> None:
    """Both executors' captures in one capture session, as an engine would open it around
    its start-up's captures: one collection before them, not one per executor."""
    from ..capture_session import capture_session

    with capture_session():
        full.capture(progress=False)
        pw.capture(kind="piecewise", progress=False)


def device_side(clock: Clock) -> dict:
    """The device's own readings around the plan and the captures (see `Clock.read`)."""
    return {"readings": clock.readings, "device_graph_bytes": clock.device_graph_bytes()}


def reference(backend: Any, model_name: str, decode: list[int], pieces: list[int]) -> dict:

    from ..memory_plan import measured_graph_memory, predict_graph_memory
    from ..models import Qwen3Model

    clock = Clock(backend)
    dtype = dtype_of(backend)

    def load() -> Any:
        return Qwen3Model.build(
            model_name, num_blocks=1, dtype=dtype, device=backend.device, weights=checkpoint()
        )

    model = clock("weights", load)

    def profile() -> list:
        """An engine's profile run before it plans (docs/engine-integration.md, section 9):
        the largest step of each kind eagerly, over placeholder executors, so the kernels
        the plan's captures run are loaded before its reading starts."""
        placeholder = _reference_executors(model, backend, decode, pieces)
        placeholder[0].warm_up([max(decode)])
        placeholder[1].warm_up([max(pieces)], kind="piecewise")
        return placeholder

    placeholder = clock("profile", profile)
    clock.read("before_plan")
    predicted = clock("plan", lambda: predict_graph_memory(*placeholder))
    clock.read("after_plan")
    clock("plan", lambda: clock.apart(lambda: _close(placeholder)))
    clock("kv_cache", lambda: clock.apart(lambda: _kv_cache(model, backend, decode, pieces)))
    full, pw = clock(
        "kv_cache",
        lambda: clock.apart(lambda: _reference_executors(model, backend, decode, pieces)),
    )
    clock("warmup", lambda: (full.warm_up(), pw.warm_up(kind="piecewise")))
    clock("capture", lambda: _capture_all(full, pw))
    clock.read("after_capture")
    tokens = clock("first_step", lambda: _reference_first_step(model, pw, max(pieces)))
    stats = [full.stats(), pw.stats()]
    out = {
        "parts": clock.parts,
        "graphs": sum(s["captures"] for s in stats),
        # where the capture part went: the captures' warm-ups, recordings and own replays
        "capture_parts": {
            k: sum(s["capture_parts"][k] for s in stats) for k in stats[0]["capture_parts"]
        },
        "predicted_bytes": predicted.total_bytes,
        "measured_bytes": measured_graph_memory(full, pw),
        "plan": predicted.as_dict(),
        **device_side(clock),
        "tokens": tokens,
    }
    _close([full, pw])
    return out


def one_process(
    target: str, backend: Any, model: str, decode: list[int], pieces: list[int], t0: float
) -> dict:
    """One process's run of a registered target (`xgraph bench startup --process`), its
    `start` part the seconds since `t0` (time.time() before the parent spawned it); printed
    as MARKER and JSON for the parent."""
    from . import startup_runner

    start = time.time() - t0  # the interpreter, the imports and the command line
    try:
        out = startup_runner(target)(backend, model, decode, pieces)
    except ImportError as exc:  # an integration's missing extra (MissingExtraError)
        out = {"skipped": f"{type(exc).__name__}: {exc}"}
    else:
        out["parts"] = {"start": start, **out["parts"]}
        out["seconds"] = sum(out["parts"].values())
        # xgraph's own share: everything but the interpreter's start, the model's imports
        # and its weights
        parts = out["parts"]
        out["xgraph_seconds"] = out["seconds"] - sum(parts.get(k, 0.0) for k in NOT_XGRAPH)
    print(MARKER + json.dumps(out), flush=True)
    return out

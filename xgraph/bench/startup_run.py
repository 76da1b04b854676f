"""One process of `xgraph bench startup`: from building the model to its first token.

    python -m xgraph.bench.startup_run --target reference --backend cuda --model qwen3-0.6b \
        --sizes 1,2,4 --pieces 4,8 --t0 TIME

Run by xgraph.bench.startup in a fresh interpreter, once with empty caches and once with
the caches the first one left (the folders come in the environment). It prints one line,
MARKER then JSON: the seconds of each part, the capture seconds per graph, the graph memory
predicted before the KV cache against the reading once every bucket is captured, and the
tokens of the first step, which the two processes must agree on.

- reference (xgraph/models/qwen3.py over its eager forward): `start` (the interpreter and
  imports, from `--t0`), `load` (weights over a placeholder cache), `plan`
  (`predict_graph_memory` of a decode and a piecewise executor, before the KV cache),
  `kv_cache` (the cache and the executors over it), `warmup` (every size run eagerly: the
  kernels' own compilation and loading, reported apart), `capture` (every size captured,
  kernels warm), `first_step` (a prefill of the prompts and its greedy tokens);
- hf (transformers' Qwen3 through `GraphModel(compile=True)`, random weights from its
  config): `start`, `load` (the model and the GraphModel: probe, cache, executor), `plan`,
  `compile` (the compiled forward's first runs: Dynamo and Inductor, or the compile
  cache's artifacts), `capture` (every decode size and every piecewise bucket), and
  `first_step` (the first token of the prompts through `generate`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

MARKER = "XGRAPH_STARTUP "
PROMPT_LENS = [37, 91]  # tokens of the prompts whose first tokens are compared
BLOCK = 16
CONTEXT = 64  # decode layout: tokens per sequence (captures touch the dummy block only)
PIECEWISE_SEQS = 16


class Clock:
    """Seconds of each part, each ending with the device's queue drained."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.parts = backend, {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        self.backend.synchronize()
        t0 = time.perf_counter()
        out = fn()
        self.backend.synchronize()
        self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0
        return out


def _prompts(vocab: int, lens: list[int] = PROMPT_LENS) -> list[list[int]]:
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

    prompts = _prompts(model.config.vocab_size, [top // 4 + 1, top // 2 + 3])
    ids, pos, slots, rows, at = [], [], [], [], 0
    for p in prompts:
        need = -(-len(p) // BLOCK)
        rows.append(list(range(at, at + need)))
        ids += p
        pos += list(range(len(p)))
        slots += list(range(at * BLOCK, at * BLOCK + len(p)))
        at += need
    lens = [len(p) for p in prompts]
    attn = AttentionInputs(lens, lens, rows, torch.tensor(slots, dtype=torch.int64))
    logits = pw(input_ids=torch.tensor(ids), positions=torch.tensor(pos), attn=attn)
    tokens = logits.argmax(-1).tolist()
    return [tokens[sum(lens[:i]) : sum(lens[: i + 1])] for i in range(len(lens))]


def _capture_all(full: Any, pw: Any) -> None:
    full.capture(progress=False)
    pw.capture(kind="piecewise", progress=False)


def reference(backend: Any, model_name: str, decode: list[int], pieces: list[int]) -> dict:
    import torch

    from ..memory_plan import measured_graph_memory, predict_graph_memory
    from ..models import Qwen3Model

    clock = Clock(backend)
    dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16

    def load() -> Any:
        return Qwen3Model.build(model_name, num_blocks=1, dtype=dtype, device=backend.device)

    model = clock("load", load)

    def plan() -> Any:
        placeholder = _reference_executors(model, backend, decode, pieces)
        try:
            return predict_graph_memory(*placeholder)
        finally:
            _close(placeholder)

    predicted = clock("plan", plan)
    clock("kv_cache", lambda: _kv_cache(model, backend, decode, pieces))
    full, pw = clock("kv_cache", lambda: _reference_executors(model, backend, decode, pieces))
    clock("warmup", lambda: (full.warm_up(), pw.warm_up(kind="piecewise")))
    clock("capture", lambda: _capture_all(full, pw))
    tokens = clock("first_step", lambda: _reference_first_step(model, pw, max(pieces)))
    out = {
        "parts": clock.parts,
        "graphs": full.stats()["captures"] + pw.stats()["captures"],
        "predicted_bytes": predicted.total_bytes,
        "measured_bytes": measured_graph_memory(full, pw),
        "plan": predicted.as_dict(),
        "tokens": tokens,
    }
    _close([full, pw])
    return out


# -- transformers' Qwen3 -------------------------------------------------------------------


def _graph_model(model: Any, backend: Any, decode: list[int], compiler: str) -> Any:
    from ..integrations.transformers import GraphModel

    return GraphModel(
        model,
        backend=backend,
        buckets=decode,
        block_size=BLOCK,
        max_model_len=max(CONTEXT, max(PROMPT_LENS) + 8),
        max_seqs=max(decode),
        max_num_tokens=max(decode),
        compile=compiler,
        on_capture_error="raise",
        name="startup-hf",
    )


def hf(backend: Any, model_name: str, decode: list[int], compiler: str) -> dict:
    import torch

    from ..integrations.transformers.bench_runs import build_named
    from ..memory_plan import measured_graph_memory

    clock = Clock(backend)
    dtype = torch.float32 if backend.device.type == "cpu" else torch.bfloat16

    def load() -> Any:
        model = build_named(model_name, dtype, backend.device)
        return _graph_model(model, backend, decode, compiler)

    gm = clock("load", load)
    ex = gm.executor
    predicted = clock("plan", ex.plan_memory)
    top = max(decode)
    clock("compile", lambda: (ex.warm_up([top, 1]), ex.warm_up([top], kind="piecewise")))
    clock("capture", gm.capture)
    prompts = _prompts(gm.spec.vocab_size)
    clock("first_step", lambda: gm.generate(prompts, 1))
    out = {
        "parts": clock.parts,
        "graphs": ex.stats()["captures"],
        "predicted_bytes": predicted.total_bytes,
        "measured_bytes": measured_graph_memory(ex),
        "compile": None if gm.compiled is None else gm.compiled.stats(),
        "tokens": gm.generate(prompts, 8).tokens,
    }
    gm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from ..cli_types import sizes

    p = argparse.ArgumentParser(prog="python -m xgraph.bench.startup_run")
    p.add_argument("--target", choices=["reference", "hf"], required=True)
    p.add_argument("--backend", default=None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--sizes", type=sizes, required=True)
    p.add_argument("--pieces", type=sizes, required=True)
    p.add_argument("--compiler", default="inductor")
    p.add_argument("--t0", type=float, required=True, help="time.time() before the spawn")
    args = p.parse_args(argv)
    import xgraph

    backend = xgraph.get_backend(args.backend)
    start = time.time() - args.t0  # the interpreter and the imports, torch's among them
    if args.target == "reference":
        out = reference(backend, args.model, args.sizes, args.pieces)
    else:
        out = hf(backend, args.model, args.sizes, args.compiler)
    out["parts"] = {"start": start, **out["parts"]}
    out["seconds"] = sum(out["parts"].values())
    print(MARKER + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

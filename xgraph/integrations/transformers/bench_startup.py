"""The transformers integration's target of `xgraph bench startup`: `hf`.

transformers' Qwen3 of the reference shape through `GraphModel(compile=True)`, decode and
piecewise graphs at the decode sizes. Parts (xgraph.bench.startup_run runs it in a fresh
process): `import` (transformers' modeling module of the model: seconds no xgraph change
can save), `weights` (`from_pretrained` of the checkpoint the bench wrote, or, without one,
random weights from the config as `bench_runs.build_named` draws them), `load` (the GraphModel:
probe, cache, executor), `compile` (the compiled
forward's first runs: Dynamo and Inductor, or the compile cache's artifacts), `plan` (its
graph memory), `warmup` (every size run eagerly: the kernels' own compilation and loading),
`capture` (every decode size and every piecewise bucket, kernels warm), `first_step` (the
first token of two prompts through `generate`). `hf-eager` is the same with the forward not
compiled (`compile=False`; its `compile` part the first eager runs): the compile's share of
the start-up, to set against what it buys per step (the transformers bench's `--compiler
none`); it runs when named (`--targets hf-eager`). `register()` offers both to the bench;
the package calls it when imported.
"""

from __future__ import annotations

from typing import Any

from ...bench import register_startup
from ...bench.startup_run import BLOCK, Clock, checkpoint, device_side, dtype_of, prompts
from ...memory_plan import measured_graph_memory
from .bench_runs import build_named, load_folder, model_class
from .model import GraphModel

TARGET = "hf"
EAGER_TARGET = "hf-eager"  # the same without the compile: what it costs and buys
PROMPT_LENS = [37, 91]
NEW_TOKENS = 8  # greedy tokens compared between the cold and the warm process


def _graph_model(model: Any, backend: Any, decode: list[int], compiled: bool) -> GraphModel:
    return GraphModel(
        model,
        backend=backend,
        buckets=decode,
        block_size=BLOCK,
        max_model_len=max(PROMPT_LENS) + NEW_TOKENS,
        max_seqs=max(decode),
        max_num_tokens=max(decode),
        compile=compiled,
        on_capture_error="raise",
        name="startup-hf",
    )


def run(
    backend: Any, model_name: str, decode: list[int], pieces: list[int], compiled: bool = True
) -> dict:
    """One process (see the module docstring); `pieces` unused: piecewise graphs come at the
    decode sizes, the GraphModel's buckets. `compiled`: False for `hf-eager`."""
    clock = Clock(backend)
    dtype = dtype_of(backend)

    clock("import", lambda: model_class(model_name))
    folder = checkpoint()
    if folder is None:
        model = clock("weights", lambda: build_named(model_name, dtype, backend.device))
    else:
        model = clock("weights", lambda: load_folder(folder, dtype, backend.device))
    gm = clock("load", lambda: _graph_model(model, backend, decode, compiled))
    ex = gm.executor
    top = max(decode)
    clock("compile", lambda: (ex.warm_up([top, 1]), ex.warm_up([top], kind="piecewise")))
    clock.read("before_plan")
    predicted = clock("plan", ex.plan_memory)  # after compile: its twins run compiled code
    clock.read("after_plan")
    # every size eagerly first: the kernels' own compilation and loading, reported apart as
    # the reference target does (each is its capture's warm-up, which the capture skips)
    clock("warmup", lambda: (ex.warm_up(decode), ex.warm_up(decode, kind="piecewise")))
    clock("capture", gm.capture)
    clock.read("after_capture")
    asked = prompts(gm.spec.vocab_size, PROMPT_LENS)
    clock("first_step", lambda: gm.generate(asked, 1))
    out = {
        "parts": clock.parts,
        "graphs": ex.stats()["captures"],
        "predicted_bytes": predicted.total_bytes,
        "measured_bytes": measured_graph_memory(ex),
        # the two sides of either number: the pool's bytes and the executables outside it
        "plan": predicted.as_dict(),
        "measured_pool_bytes": ex.memory.graph_bytes(),
        "measured_outside_bytes": ex.stats()["outside_pool_bytes"],
        **device_side(clock),
        "compile": None if gm.compiled is None else gm.compiled.stats(),
        "tokens": gm.generate(asked, NEW_TOKENS).tokens,
    }
    gm.close()
    return out


def run_eager(backend: Any, model_name: str, decode: list[int], pieces: list[int]) -> dict:
    """`hf-eager`: the same process with the forward not compiled (`compile=False`)."""
    return run(backend, model_name, decode, pieces, compiled=False)


def register() -> None:
    register_startup(TARGET, run)
    # named only (`--targets hf-eager`): the compile's share, measured when asked for
    register_startup(EAGER_TARGET, run_eager, default=False)

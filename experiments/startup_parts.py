"""Where a transformers Qwen3 process's start-up goes, finer than `xgraph bench startup`'s
parts: the weights split into the modeling module's import, `from_config` and the move; the
GraphModel's load, compile, plan, an eager warm-up of every size (the kernels' own
compilation) and the capture; and in each part, Triton's compiles (count, seconds, by
kernel) through its compilation listener.

    OUT=out python experiments/startup_parts.py --model qwen3-0.6b

Runs two fresh interpreters over one temporary folder of caches (xgraph's, Inductor's,
Triton's), the first with them empty and the second with what the first left, as the bench
does. Writes $OUT/startup-parts.json. `--profile` samples every part of the warm process's
Python stack and keeps each part's heaviest functions (`profile`: inclusive and own
seconds), to say where a warm start's seconds go.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

T0 = time.time()
MARK = "STARTUP_PARTS "
CACHES = {
    "XGRAPH_COMPILE_CACHE": "xgraph-compile",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
}


class Compiles:
    """Triton's compiles per part: misses by kernel name with their seconds, and hits."""

    def __init__(self) -> None:
        self.part = "start"
        self.misses: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
        self.hits: dict = defaultdict(int)

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.hits[self.part] += 1
            return
        us = times.ir_initialization + times.total_lowering + times.store_results
        entry = self.misses[self.part][getattr(src, "name", "?")]
        entry[0] += 1
        entry[1] += us / 1e6

    def as_dict(self) -> dict:
        return {
            part: {
                "compiles": sum(c for c, _ in kernels.values()),
                "seconds": sum(s for _, s in kernels.values()),
                "kernels": {k: {"compiles": c, "seconds": s} for k, (c, s) in kernels.items()},
                "hits": self.hits.get(part, 0),
            }
            for part, kernels in self.misses.items()
        } | {p: {"hits": h} for p, h in self.hits.items() if p not in self.misses}


class Sampler:
    """A wall-clock sampler of the main thread's Python stack (a thread reading
    `sys._current_frames` every `interval` s): seconds per function, inclusive (on the stack)
    and own (at its top). cProfile's own and cumulative times do not add up across the
    dispatcher's C++ re-entries into Python (custom ops, Dynamo's frames); samples do."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.main = interval, threading.main_thread().ident
        self.inclusive: Counter = Counter()
        self.own: Counter = Counter()
        self.samples, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.main)
            if frame is None:
                continue
            self.samples += 1
            seen = set()
            top = True
            while frame is not None:
                c = frame.f_code
                key = f"{c.co_filename.split('site-packages/')[-1]}:{c.co_firstlineno}({c.co_name})"
                if top:
                    self.own[key] += 1
                    top = False
                if key not in seen:
                    seen.add(key)
                    self.inclusive[key] += 1
                frame = frame.f_back

    def __enter__(self) -> Sampler:
        # the sampler needs the GIL: the main thread hands it over every interval, not 5 ms
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 2)
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.seconds = time.perf_counter() - self.t0

    def heaviest(self, top: int = 30) -> dict:
        """The functions with the most inclusive and own seconds (samples scaled to the
        part's wall time)."""
        per = self.seconds / max(self.samples, 1)

        def best(c: Counter) -> list:
            return [{"fn": k, "s": round(n * per, 4)} for k, n in c.most_common(top)]

        return {"samples": self.samples, "inclusive": best(self.inclusive), "own": best(self.own)}


def child(model_name: str, profile: bool = False) -> dict:
    """One process: every part timed with the device drained at its ends (sampled with
    `profile`)."""
    start = time.time() - T0
    import torch
    import triton

    import xgraph
    from xgraph.bench.startup_run import prompts
    from xgraph.buckets import vllm_capture_sizes
    from xgraph.integrations.transformers.bench_runs import build_named
    from xgraph.integrations.transformers.bench_startup import PROMPT_LENS, _graph_model

    compiles = Compiles()
    triton.knobs.compilation.listener = compiles
    backend = xgraph.get_backend("cuda")
    parts: dict = {"start": start}
    profiles: dict = {}

    def clock(name, fn):
        compiles.part = name
        backend.synchronize()
        sampler = Sampler() if profile else contextlib.nullcontext()
        t0 = time.perf_counter()
        with sampler:
            out = fn()
            backend.synchronize()
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        if isinstance(sampler, Sampler):
            profiles[name] = sampler.heaviest()
        return out

    clock("cuda_init", lambda: torch.empty(1, device="cuda"))
    clock("import_modeling", lambda: __import__("transformers.models.qwen3.modeling_qwen3"))
    clock("build", lambda: build_named(model_name, torch.bfloat16, backend.device))
    model = clock("build_again", lambda: build_named(model_name, torch.bfloat16, backend.device))
    decode = vllm_capture_sizes(512)
    gm = clock("load", lambda: _graph_model(model, backend, decode, True))
    ex, top = gm.executor, max(decode)
    clock("compile", lambda: (ex.warm_up([top, 1]), ex.warm_up([top], kind="piecewise")))
    clock("plan", ex.plan_memory)
    clock("warmup_decode", lambda: ex.warm_up(decode))
    clock("warmup_piecewise", lambda: ex.warm_up(decode, kind="piecewise"))
    clock("capture", gm.capture)
    asked = prompts(gm.spec.vocab_size, PROMPT_LENS)
    clock("first_step", lambda: gm.generate(asked, 1))
    out = {
        "parts": parts,
        "triton": compiles.as_dict(),
        "compile": None if gm.compiled is None else gm.compiled.stats(),
        "tokens": gm.generate(asked, 8).tokens,
        "profile": profiles,
    }
    gm.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--child", action="store_true")
    p.add_argument("--profile", action="store_true", help="sample the warm process's stacks")
    a = p.parse_args()
    if a.child:
        print(MARK + json.dumps(child(a.model, a.profile)), flush=True)
        return
    data: dict = {"model": a.model}
    with tempfile.TemporaryDirectory(prefix="startup-parts-") as caches:
        env = {**os.environ, **{k: os.path.join(caches, v) for k, v in CACHES.items()}}
        for phase in ("cold", "warm"):
            cmd = [sys.executable, __file__, "--child", "--model", a.model]
            cmd += ["--profile"] if a.profile and phase == "warm" else []
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
            lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
            if not lines:
                data[phase] = {"error": (proc.stderr or proc.stdout)[-3000:]}
            else:
                data[phase] = json.loads(lines[-1][len(MARK) :])
            print(phase, json.dumps(data[phase].get("parts", data[phase]), indent=1), flush=True)
    path = os.path.join(os.environ.get("OUT", "out"), "startup-parts.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()

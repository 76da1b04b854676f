"""Several decode steps per launch through a Hugging Face model (GraphModel's engine): the
same greedy and seeded tokens for K = 1, 2, 8, with requests of different lengths, stop
tokens, and a request arriving while others decode."""

from __future__ import annotations

import random

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY, tiny  # noqa: E402

from xgraph.integrations.transformers import GraphModel, SamplingParams  # noqa: E402

LENS = (7, 3, 12)
NEW = [9, 5, 12]


def _prompts(seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in LENS]


@pytest.fixture(scope="module")
def gm():
    with GraphModel(tiny("qwen3", seed=2), backend="cpu", **LIMITS) as g:
        yield g


@pytest.mark.parametrize("k", [2, 8])
def test_multi_step_greedy_and_seeded_tokens_equal_one_step_at_a_time(gm, k):
    ps = _prompts()
    hot = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=11)
    for sampling in (None, hot):
        want = gm.generate(ps, NEW, sampling=sampling)
        got = gm.generate(ps, NEW, sampling=sampling, steps_per_launch=k)
        assert got.tokens == want.tokens
        assert got.finish_reasons == want.finish_reasons
        assert got.decode_tokens == want.decode_tokens
    stats = gm.decode_loop(k).stats()
    assert set(stats) == {"greedy", "sample"}
    assert all(s["replays"] > 0 and not s["eager"] for s in stats.values())  # graphs ran


@pytest.mark.slow
def test_multi_step_of_a_compiled_model_runs_its_choice_and_feedback_compiled():
    """GraphModel(compile=...): the loops of every K share one StepTail compiled under the
    model's compiler; the tokens are those of one step at a time."""
    ps = _prompts(7)
    with GraphModel(tiny("qwen3", seed=2), backend="cpu", compile="aot_eager", **LIMITS) as cgm:
        want = cgm.generate(ps, NEW)
        got = cgm.generate(ps, NEW, steps_per_launch=4)
        assert got.tokens == want.tokens
        tail = cgm.decode_loop(4).tail
        assert cgm.decode_loop(2).tail is tail
        greedy = tail.stats()["greedy"]
        assert greedy["compiles"] >= 1 and greedy["fallback"] is None  # its warm-ups ran it
        assert cgm.decode_loop(4).executor().compiled


def test_multi_step_stops_at_a_stop_token_and_admits_between_launches(gm):
    ps = _prompts(5)
    free = gm.generate(ps, NEW).tokens
    stop = free[0][2]  # the third token of the first request ends it
    engine = gm.engine(steps_per_launch=8, eos_token_id=stop)
    one = gm.engine(eos_token_id=stop)
    for e in (engine, one):
        for p, n in zip(ps[:2], NEW[:2]):
            e.add(p, n)
    first = engine.step()  # the prefill step, one at a time
    assert len(first) == 2
    late = engine.step()  # a launch of 8 decode steps
    assert max(sum(1 for ev in late if ev.index == i) for i in range(2)) > 1
    engine.add(ps[2], NEW[2])  # joins between launches
    one.add(ps[2], NEW[2])
    got = engine.run().tokens
    want = one.run().tokens
    assert got == want
    assert engine.totals["queued_launches"] > 0  # launches queued behind launches
    assert got[0] == free[0][: free[0].index(stop) + 1]  # ended at its stop token


def test_multi_step_queues_the_next_launch_only_while_no_request_waits(gm):
    """With a request waiting the engine reads every launch back before the next step (it
    joins at once); with none it queues the next launch behind the current one."""
    ps = _prompts(9)
    engine = gm.engine(steps_per_launch=2)
    engine.add(ps[0], 12)
    engine.step()  # prefill
    engine.add(ps[1], 12)  # waits: the next step is a launch, read back before admitting it
    engine.step()
    assert engine.totals["queued_launches"] == 0
    got = engine.run()
    assert engine.totals["queued_launches"] > 0
    alone = gm.engine()
    for p in ps[:2]:
        alone.add(p, 12)
    assert got.tokens == alone.run().tokens


def test_xgraph_generate_steps_per_launch_prints_the_same_tokens(tmp_path, capsys):
    from xgraph.cli import main

    tiny("qwen3", seed=2).save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--prompt", "1 2 3", "--prompt", "4 5"]
    base += ["--max-new-tokens", "6", "--backend", "cpu", "--ignore-eos", "--seed", "5"]
    base += ["--temperature", "1.2"]
    runs = []
    for k in ("1", "4"):
        assert main([*base, "--steps-per-launch", k]) == 0
        out = capsys.readouterr().out
        runs.append([line for line in out.splitlines() if line.startswith("[")])
    assert len(runs[0]) == 2 and runs[0] == runs[1]
    with pytest.raises(SystemExit) as exc:
        main([*base, "--steps-per-launch", "0"])
    assert exc.value.code == 2 and "--steps-per-launch" in capsys.readouterr().err


def test_bench_multistep_rows_on_cpu(tmp_path):
    import json

    from xgraph.integrations.transformers import bench_multistep

    path = tmp_path / "multistep.json"
    argv = ["--backend", "cpu", "--model", "tiny", "--dtype", "float32", "--batches", "1,2"]
    argv += ["--k", "4", "--prompt-len", "8", "--new-tokens", "8", "--iters", "1"]
    assert bench_multistep.main([*argv, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [(r["batch"], r["k"]) for r in data["rows"]] == [(1, 4), (2, 4)]
    for r in data["rows"]:
        assert r["tokens_equal"] is True  # greedy: K steps per launch change no token
        assert r["tokens_per_s"] > 0 and r["single_step_tokens_per_s"] > 0
        assert r["speedup"] == r["tokens_per_s"] / r["single_step_tokens_per_s"]
        assert r["graph_step_ms"] > 0 and r["launch_step_ms"] > 0 and r["head_and_argmax_ms"] > 0
        with_head = r["graph_step_ms"] + r["head_and_argmax_ms"]
        assert r["per_token_over_step_and_head"] == pytest.approx(r["per_token_ms"] / with_head)
        kernels = r["kernels"]  # the CPU backend's recordings: its ops, eager
        assert kernels["source"] == "recorded ops" and kernels["graph_step"] > 0
        # a step in a launch: the decoder's ops, then the head, the choice and the feedback
        assert kernels["launch_per_step"] > kernels["graph_step"]
        assert kernels["launch_per_step"] == kernels["launch"] / r["k"]

"""The generation loop over a GraphModel (CPU backend, float32): continuous batching,
stop tokens and max tokens, streamed tokens, latencies; logits only for the rows that
sample; the projections through xgraph.linear, bit for bit on the CPU backend."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY, tiny  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import xgraph.linear as xlinear  # noqa: E402
from xgraph.backends.cpu import CPUBackend  # noqa: E402
from xgraph.integrations.transformers import GraphModel, SamplingParams  # noqa: E402
from xgraph.integrations.transformers.linears import XLinear  # noqa: E402
from xgraph.interfaces import Kernels  # noqa: E402


def prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def gm():
    with GraphModel(tiny("qwen3"), backend="cpu", on_capture_error="raise", **LIMITS) as g:
        yield g


def alone(gm: GraphModel, p: list[int], new: int) -> list[int]:
    return gm.generate([p], new).tokens[0]


def test_prompts_that_join_while_others_decode_get_their_own_tokens(gm):
    first, late = prompts(1, (7, 5)), prompts(2, (21, 3))
    engine = gm.engine()
    for p in first:
        engine.add(p, 8)
    kinds = []
    for i in range(20):
        if not engine.has_work:
            break
        if i == 3:  # both are decoding by now: the new prompts join them
            for p in late:
                engine.add(p, 5)
        before = gm.stats()["hits"].copy()
        engine.step()
        after = gm.stats()["hits"]
        kinds += [k[0] for k in after if after[k] != before.get(k, -1)]
    result = engine.result()
    assert "piecewise" in kinds[3:]  # a mixed step: decode tokens and a prompt chunk
    for p, new, got in zip(first + late, [8, 8, 5, 5], result.tokens):
        assert got == alone(gm, p, new)
    assert result.finish_reasons == ["length"] * 4


def test_stop_tokens_end_a_request_and_free_its_seat(gm):
    ps = prompts(3, (6, 9))
    free = gm.generate(ps, 8).tokens
    stop = free[0][2]
    engine = gm.engine(eos_token_id=[stop])
    engine.add(ps[0], 8)
    engine.add(ps[1], 8, stop_token_ids=free[1][1])
    result = engine.run()
    assert result.tokens[0] == free[0][: free[0].index(stop) + 1]
    assert result.tokens[1] == free[1][:2] or stop in free[1][:2]
    assert result.finish_reasons == ["stop", "stop"]
    assert engine.allocator.free == gm.limits.num_blocks  # every block given back


def test_streamed_tokens_arrive_in_order_and_end_with_finished(gm):
    ps = prompts(4, (5, 12, 3))
    whole = gm.generate(ps, [4, 6, 2]).tokens
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished = []
    for event in gm.stream(ps, [4, 6, 2]):
        assert event.index not in finished
        seen[event.index].append(event.token)
        if event.finished:
            finished.append(event.index)
    assert [seen[i] for i in range(3)] == whole
    assert sorted(finished) == [0, 1, 2]
    calls = []
    gm.generate(ps, [4, 6, 2], on_token=calls.append)
    assert [e.token for e in calls if e.index == 1] == whole[1]


def test_the_result_reports_latencies_and_tokens_per_second(gm):
    result = gm.generate(prompts(5, (9, 4, 17)), 5, progress=True)
    assert len(result.ttft) == 3 and all(t > 0 for t in result.ttft)
    assert len(result.per_token) == 3 * 4 and all(t >= 0 for t in result.per_token)
    lat = result.latency()
    assert lat["ttft_p50_s"] <= lat["ttft_p99_s"] and lat["per_token_p50_s"] > 0
    line = result.summary()
    assert "tokens/s" in line and "time to first token p50" in line and "p99" in line


def test_logits_only_for_the_rows_that_sample(gm, monkeypatch):
    """A 29-token prompt in chunks of 16 and a 5-token one: the head sees one row per
    prompt when it ends, then one per decoding sequence; never a prompt's other rows."""
    head = gm.head
    assert head is not None
    rows = []
    projection = head.projection

    def counting(hidden):  # type: ignore[no-untyped-def]
        rows.append(hidden.shape[0])
        return projection(hidden)

    # the head's own projection: the forward keeps the head (its decoder runs the graphs)
    monkeypatch.setattr(head, "projection", counting)
    result = gm.generate(prompts(6, (29, 5)), 3)
    assert sum(rows) == result.generated_tokens == 6
    assert max(rows) <= 2


def test_a_sequence_of_requests_samples_reproducibly_per_seed(gm):
    ps = prompts(7, (6, 6, 8))
    hot = SamplingParams(temperature=1.2, seed=5)
    cold = SamplingParams()
    engine = gm.engine()
    for p, s in zip(ps, (hot, cold, hot)):
        engine.add(p, 6, sampling=s)
    mixed = engine.run().tokens
    again = gm.engine()
    for p, s in zip(ps, (hot, cold, hot)):
        again.add(p, 6, sampling=s)
    assert again.run().tokens == mixed
    assert mixed[1] == alone(gm, ps[1], 6)  # the greedy request among sampled ones


def test_xgraph_linear_swap_is_bit_exact_on_the_cpu_backend_and_undone_on_close():
    model = tiny("llama", seed=1)
    ps = prompts(8, (11, 4))
    with GraphModel(model, backend="cpu", linear=False, **LIMITS) as plain:
        want = plain.generate(ps, 5, record_logits=True)
    with GraphModel(model, backend="cpu", linear=True, **LIMITS) as gm:
        swapped = [m for m in model.modules() if type(m) is XLinear]
        assert len(swapped) == 7 * TINY["num_hidden_layers"]  # q k v o gate up down
        assert type(model.lm_head) is torch.nn.Linear  # the head runs outside the graphs
        got = gm.generate(ps, 5, record_logits=True)
    assert got.tokens == want.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert not any(type(m) is XLinear for m in model.modules())


def test_projections_reach_the_backends_linear_kernel_eager_and_compiled():
    """With a kernel installed for the device, the projections call it with the tokens as
    rows (a 2-d input), eagerly and from compiled code (the xgraph::linear op), q/k/v and
    gate/up as one merged call each: four calls a layer, and the same tokens."""
    seen = []

    def kernel(x, w):  # type: ignore[no-untyped-def]
        seen.append((x.dim(), tuple(w.shape)))
        return torch.nn.functional.linear(x, w)

    class WithKernel(CPUBackend):
        def kernels(self) -> Kernels:
            return Kernels(linear=kernel)

    model = tiny("qwen3", seed=2)
    ps = prompts(9, (7, 3))
    with GraphModel(model, backend="cpu", linear=False, **LIMITS) as plain:
        want = plain.generate(ps, 4).tokens
    layers, qkv = TINY["num_hidden_layers"], (4 + 2 + 2) * 16
    try:
        for compile in (False, "aot_eager"):
            torch._dynamo.reset()
            counters.clear()
            backend = WithKernel()
            with GraphModel(model, backend=backend, compile=compile, mode="eager", **LIMITS) as gm:
                seen.clear()
                gm.generate([ps[0]], 1)  # one step: one forward
                assert len(seen) == 4 * layers and {d for d, _ in seen} == {2}
                assert (qkv, 64) in {w for _, w in seen} and (256, 64) in {w for _, w in seen}
                assert gm.generate(ps, 4).tokens == want
            assert dict(counters["graph_break"]) == {}
            assert not any(type(m) is XLinear for m in model.modules())
    finally:
        xlinear.install("cpu", None, "test")
        torch._dynamo.reset()


def test_xgraph_generate_compile_and_stream(tmp_path, capsys):
    from xgraph.cli import main

    tiny("llama", seed=3).save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--prompt", "1 2 3", "--prompt", "4 5"]
    base += ["--max-new-tokens", "4", "--backend", "cpu", "--ignore-eos"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    torch._dynamo.reset()
    assert main([*base, "--compile", "aot_eager", "--stream"]) == 0
    streamed = capsys.readouterr().out
    torch._dynamo.reset()
    tokens = {
        i: [int(t) for t in line.split("] ", 1)[1].strip("[]").split(", ")]
        for line in plain.splitlines()
        if line.startswith("[")
        for i in [int(line[1 : line.index("]")])]
    }
    events = [line for line in streamed.splitlines() if line.startswith("[")]
    assert len(events) == 8 and sum("(end)" in e for e in events) == 2
    for i in (0, 1):
        got = [int(e.split("] ")[1].split()[0]) for e in events if e.startswith(f"[{i}]")]
        assert got == tokens[i]
    assert "time to first token p50" in streamed and "per-token latency p50" in plain

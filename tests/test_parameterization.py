"""The parameterization-leak check on the CPU backend (GraphExecutor.check_parameterization).

Planted leaks: a graph-safe decode runner whose op shape, or a non-tensor argument, comes
from a Python int of the longest sequence; a model whose rotary slice in a piece follows
the prefill runner's plan. Each is flagged, named (op, position, layer, model line) and
attributed to the metadata whose change shows it; the reference model passes; the check
keeps nothing (stats, graph memory, VMM books, the KV cache outside the dummy block).
"""

from __future__ import annotations

import random

import pytest
import torch

import xgraph
from xgraph import XGraphError, XGraphWarning
from xgraph.backends.cpu.graph import CPUGraph
from xgraph.contract import check_backend_class
from xgraph.errors import IncompleteBackendError, InputError, ParameterizationLeakError
from xgraph.models import Workload
from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

BUCKETS = [1, 2, 4, 8]


def longest(runner: PagedDecodeRunner) -> int:
    return max(int(n) for n in runner.planned().seq_lens_host)


class ShapeLeak(PagedDecodeRunner):
    """Graph-safe by its claim; an op's shape follows the longest sequence."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        out.add_(torch.zeros(longest(self), device=q.device).sum())  # the planted leak


class ScalarLeak(PagedDecodeRunner):
    """An op's non-tensor argument follows the longest sequence."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        out.add_(torch.full_like(out, float(longest(self))), alpha=0.0)  # the planted leak


class PlannedPrefill(PagedPrefillRunner):
    """Keeps the longest sequence of the planned step for the model to read."""

    def plan(self, metadata):  # type: ignore[no-untyped-def]
        super().plan(metadata)
        self.longest = max(int(n) for n in metadata.seq_lens_host)


def executor(w: Workload, **kw):  # type: ignore[no-untyped-def]
    return w.executor(backend="cpu", buckets=BUCKETS, **kw)


def test_the_reference_model_passes_for_both_kinds():
    w = Workload.tiny()
    with executor(w) as ex:
        report = ex.check_parameterization()
    assert report.ok and not report.unstable, report
    assert [k.key for k in report.keys] == [("full", 4), ("piecewise", 4)]
    for k in report.keys:
        assert k.recordings == 5 and k.launches > 50
        assert k.varied == ["sequence lengths", "block tables", "batch composition"]
    assert str(report).startswith("parameterization check on cpu: no leak.")
    report.raise_for_leaks()  # nothing to raise


def test_an_op_whose_shape_follows_the_longest_sequence_is_flagged_and_named():
    w = Workload.tiny()
    with executor(w, attention=w.attention(decode_runner=ShapeLeak())) as ex:
        report = ex.check_parameterization(kind="full")
    assert not report.ok
    layers = w.model.config.num_layers
    zeros = [d for d in report.differences if d.site.launch.name == "aten::zeros"]
    assert len(zeros) == layers  # once per attention layer, nothing else
    d = zeros[0]
    assert (d.field, d.first, d.second) == ("size", (1,), (32,))  # 8 blocks of 4 slots
    assert d.varied == ["sequence lengths"] and d.key == ("full", 4)
    assert d.site.launch.layer.startswith("model.layers.0.self_attn at ")
    assert "torch.zeros(longest(self)" in d.site.launch.layer  # the model line
    text = str(report)
    assert f"op {d.site.position} aten::zeros (model.layers.0.self_attn at " in text
    assert "size: (1,) -> (32,) (sequence lengths changed)" in text
    assert "Put that dim in the key" in text and "run that op between" in text
    with pytest.raises(ParameterizationLeakError, match="aten::zeros"):
        report.raise_for_leaks()


def test_a_non_tensor_argument_that_follows_the_longest_sequence_is_flagged():
    w = Workload.tiny()
    with executor(w, attention=w.attention(decode_runner=ScalarLeak())) as ex:
        report = ex.check_parameterization(kind="full", sizes=[8])
    (d, *_) = report.differences
    assert d.site.launch.name == "aten::full_like" and d.field == "fill_value"
    assert (d.first, d.second, d.varied) == (1.0, 32.0, ["sequence lengths"])
    assert {x.site.launch.name for x in report.differences} == {"aten::full_like"}


def test_a_piece_that_follows_the_prefill_plan_is_flagged_in_its_piece():
    w = Workload.tiny()
    runner = PlannedPrefill()

    def forward(input_ids, positions):  # type: ignore[no-untyped-def]
        logits = w.model.forward_logits(input_ids, positions)
        return logits + torch.arange(runner.longest).sum() * 0  # the planted leak

    with executor(w, attention=w.attention(prefill_runner=runner)) as ex:
        ex.forward = forward
        report = ex.check_parameterization(kind="piecewise")
    d, total = report.differences  # the arange and the sum over it
    assert d.site.launch.name == "aten::arange" and d.field == "end" and d.first == 4
    assert total.site.launch.name == "aten::sum" and total.first == "int64[4]"
    assert "(`return logits + torch.arange(runner.longest).sum() * 0" in d.site.launch.layer
    assert d.site.piece == w.model.config.num_layers  # the last piece: after the last layer
    assert set(d.varied) == {"sequence lengths", "batch composition"}
    assert f"in piece {d.site.piece}" in str(report) and "(piecewise graphs)" in str(report)


def test_the_check_keeps_nothing():
    w, ref = Workload.tiny(), Workload.tiny()
    cpu = xgraph.get_backend("cpu")
    ex = w.executor(backend=cpu, buckets=BUCKETS)
    rng = random.Random(3)
    step = w.decode_step(rng, 3)
    ex(**step.kwargs())  # a graph and its memory exist before the check
    w.cache.layers[0][0][-1].fill_(7.0)  # the dummy block
    cache = [t.clone() for t in w.cache.real()]
    stats, books = ex.stats(), cpu.virtual_memory().live()
    report = ex.check_parameterization(sizes=[2, 8], kind=None)
    assert report.ok and len(report.keys) == 4
    assert ex.stats() == stats and cpu.virtual_memory().live() == books
    assert all(torch.equal(a, b) for a, b in zip(w.cache.real(), cache))
    step = w.decode_step(rng, 4)  # the cached graphs still replay right
    for a, b in zip(ref.cache.tensors(), w.cache.tensors()):
        a.copy_(b)
    padded = ref.padded(step, xgraph.Buckets(BUCKETS), full=True)
    assert torch.equal(ex(**step.kwargs()), ref.eager(padded)[:4])
    ex.close()


def test_a_failing_capture_is_raised_and_rolled_back():
    w = Workload.tiny()

    def forward(input_ids, positions):  # type: ignore[no-untyped-def]
        h = w.model.forward_logits(input_ids, positions)
        return h * (h[0, 0].item() != 1e9)  # a host read: the capture fails

    cpu = xgraph.get_backend("cpu")
    with executor(w) as ex:
        ex.forward = forward
        books = cpu.virtual_memory().live()
        with pytest.raises(xgraph.CaptureError, match=r"item\(\)"):
            ex.check_parameterization(kind="full")
        assert cpu.virtual_memory().live() == books and ex.stats()["captures"] == 0


def test_engine_steps_of_one_key_are_compared():
    w = Workload.tiny()
    rng = random.Random(5)
    short = w.step(rng, [1, 1, 1], [2, 3, 1])
    long = w.step(rng, [1, 1, 1, 1], [30, 17, 9, 25])
    with executor(w, attention=w.attention(decode_runner=ShapeLeak())) as ex:
        report = ex.check_parameterization(steps=[short.kwargs(), long.kwargs()])
        assert [k.key for k in report.keys] == [("full", 4)]
        d = report.differences[0]
        assert (d.field, d.first, d.second, d.varied) == ("size", (3,), (30,), ["step 2"])
        other = w.decode_step(rng, 7)
        with pytest.raises(XGraphError, match=r"maps to key \('full', 8\)"):
            ex.check_parameterization(steps=[short.kwargs(), other.kwargs()])
        with pytest.raises(InputError, match="two or more steps"):
            ex.check_parameterization(steps=[short.kwargs()])
        huge = w.decode_step(rng, 9)
        with pytest.raises(XGraphError, match="runs eagerly"), pytest.warns(XGraphWarning):
            ex.check_parameterization(steps=[huge.kwargs(), huge.kwargs()])


def test_what_a_key_leaves_no_room_for_is_said():
    w = Workload.tiny()
    with executor(w) as ex:
        report = ex.check_parameterization(sizes=[1, 2], kind="full")
    k1, k2 = report.keys
    assert k1.not_varied == ["batch composition: every decode step of bucket 1 has 1 sequence"]
    assert k2.varied == ["sequence lengths", "block tables"]  # 2 pads 2 only: the bucket below is 1
    assert "not varied: batch composition" in str(report)


def test_an_executor_without_attention_varies_its_real_number_of_tokens():
    from xgraph import GraphExecutor, Input

    weight = torch.randn(8, 8)
    ex = GraphExecutor(
        lambda x: x @ weight,
        backend="cpu",
        buckets=[2, 8],
        inputs=[Input("x", torch.float32, ("num_tokens", 8))],
    )
    report = ex.check_parameterization()
    (k,) = report.keys
    assert report.ok and k.key == ("full", 8) and k.varied == ["batch composition"]
    assert len(k.not_varied) == 2
    ex.close()


def test_bad_arguments_are_refused():
    w = Workload.tiny()
    with executor(w) as ex:
        with pytest.raises(InputError, match="vary"):
            ex.check_parameterization(vary=["seq_len"])
        with pytest.raises(XGraphError, match="kind='eager'"):
            ex.check_parameterization(kind="eager")
        with pytest.raises(InputError, match="sizes holds 99"):
            ex.check_parameterization(sizes=[99])
    with executor(Workload.tiny(), mode="eager") as ex:
        with pytest.raises(XGraphError, match="mode='eager' records no graphs"):
            ex.check_parameterization()


def test_an_executor_in_lockstep_with_peers_is_refused_rather_than_left_waiting():
    w = Workload.tiny()
    with executor(w) as ex:
        ex.lockstep = object()  # stands for a Lockstep: its planner would agree each step
        with pytest.raises(XGraphError, match="runs on one rank"):
            ex.check_parameterization()


def test_a_backend_that_cannot_read_its_graphs_says_so(monkeypatch):
    monkeypatch.setattr(CPUGraph, "_keep_launches", lambda self: False)
    w = Workload.tiny()
    with executor(w) as ex:
        with pytest.raises(XGraphError, match="cannot read what its graphs record"):
            ex.check_parameterization()


def test_launches_need_a_kept_capture():
    g = xgraph.get_backend("cpu").new_graph()
    x = torch.ones(4)
    with xgraph.graph(g):
        x.mul_(2)
    with pytest.raises(XGraphError, match="keep_launches"):
        g.launches()
    g.reset()
    assert g.keep_launches()
    with xgraph.graph(g):
        with pytest.raises(XGraphError, match="before capture_begin"):
            g.keep_launches()
        x.mul_(3)
    (op,) = g.launches()
    assert (op.kind, op.name, dict(op.config)["other"]) == ("op", "aten::mul_", 3)
    g.reset()
    assert not g._keeping  # reset forgets it: the next capture is not kept


def test_an_adapter_writing_half_of_a_pair_is_refused():
    from xgraph.backends.cpu import CPUBackend
    from xgraph.device.runtime import TorchRuntime

    class HalfGraph(CPUGraph):
        _keep_launches = xgraph.interfaces.Graph._keep_launches  # the default: not readable

    class HalfBackend(CPUBackend):
        graph_class = HalfGraph

    check_backend_class(CPUBackend)
    with pytest.raises(
        IncompleteBackendError, match=r"HalfGraph\._keep_launches \(it writes _launches\)"
    ):
        check_backend_class(HalfBackend)

    from xgraph_dummy.backend import DummyBackend, DummyRuntime

    class HalfRuntime(DummyRuntime):
        graph_launches = TorchRuntime.graph_launches

    class HalfTorch(DummyBackend):
        runtime_class = HalfRuntime

    with pytest.raises(
        IncompleteBackendError, match=r"HalfRuntime\.graph_launches \(it writes readable_graph\)"
    ):
        check_backend_class(HalfTorch)


# -- per-call values, branches, multi-token graphs ------------------------------------------


class PerCallCounter(PagedDecodeRunner):
    """An op's size follows a count of calls: neither the key nor the metadata."""

    graph_safe = True

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        self.calls += 1
        out.add_(torch.zeros(self.calls).sum())  # the planted leak
        out.add_(torch.full_like(out, float(self.calls)), alpha=0.0)  # and as a scalar


def test_a_launch_sized_by_a_per_call_counter_is_a_leak():
    w = Workload.tiny()
    with executor(w, attention=w.attention(decode_runner=PerCallCounter())) as ex:
        report = ex.check_parameterization(kind="full")
    assert not report.ok
    names = {(d.site.launch.name, d.field) for d in report.differences}
    assert names == {
        ("aten::zeros", "size"),
        ("aten::sum", "self"),
        ("aten::full_like", "fill_value"),
    }
    assert all(d.per_call for d in report.differences) and report.unstable == report.differences
    zeros = [d for d in report.differences if d.site.launch.name == "aten::zeros"]
    assert len(zeros) == w.model.config.num_layers
    first, second = zeros[0].first[0], zeros[0].second[0]
    assert second > first  # two captures of the same step, the counter moved on between them
    assert zeros[0].varied[0] == "nothing (the same step again)"
    text = str(report)
    assert "follow per-call values." in text
    assert "(per call: two captures of the same step differ; also under changed" in text
    assert "What to do (per call)" in text and "What to do (full graphs)" not in text
    assert "addresses, padding" not in text
    with pytest.raises(ParameterizationLeakError, match="per call"):
        report.raise_for_leaks()


def test_what_a_backend_cannot_compare_is_counted_not_hidden():
    from xgraph.interfaces import Launch
    from xgraph.launchdiff import Site, compare, unchecked
    from xgraph.launches import ADDRESS, by_value

    def rec(n: int, word: int) -> list[Site]:
        cfg = (("arg 0", ADDRESS), ("arg 1", by_value(16)), ("arg 2", n), ("arg 3", word))
        return [Site(0, None, Launch("kernel", "k", cfg))]

    assert compare(("full", 4), rec(8, 1), rec(8, 1)) == []  # marks compare equal
    (d,) = compare(("full", 4), rec(8, 1), rec(8, 2))  # an unmarked word: a difference
    assert (d.field, d.first, d.second) == ("arg 3", 1, 2)
    assert unchecked(rec(8, 1)) == {"address": 1, "struct": 1}
    assert describe_has_no_address()


def describe_has_no_address() -> bool:
    from xgraph.launches import describe

    return "0x" not in describe(torch.Generator()) and describe(torch.float16) == "torch.float16"


def _line_of(tag: str) -> int:
    """The one line of this file that ends with the comment `# tag`."""
    with open(__file__) as f:
        (n,) = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {tag}")]
    return n


class BranchLeak(PagedDecodeRunner):
    """A Python branch on the longest sequence: one side issues an op the other does not."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        longest = max(int(n) for n in self.planned().seq_lens_host)
        out.mul_(1.0)  # before the branch
        if longest > 8:  # the planted branch
            out.sub_(0.0)  # one side only
        out.add_(0.0)  # after the branch


class ElseLeak(PagedDecodeRunner):
    """Both arms issue the same op, with other arguments."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        longest = max(int(n) for n in self.planned().seq_lens_host)
        if longest <= 8:  # the planted else-branch
            out.mul_(1.0)
        else:
            out.mul_(2.0)


class LoopLeak(PagedDecodeRunner):
    """A loop whose trip count follows the longest sequence."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        longest = max(int(n) for n in self.planned().seq_lens_host)
        for _ in range(longest // 16 + 1):  # the planted loop
            out.add_(0.0)
        out.mul_(1.0)


def test_a_python_branch_leak_names_the_branch_not_the_next_op():
    w = Workload.tiny()
    with executor(w, attention=w.attention(decode_runner=BranchLeak())) as ex:
        report = ex.check_parameterization(kind="full")
    d = report.differences[0]
    assert (d.field, d.first, d.second) == ("launches", ["nothing"], ["op aten::sub_"])
    assert d.varied == ["sequence lengths"] and len(report.differences) == w.model.config.num_layers
    me = __file__
    branch = d.branch
    assert (
        branch.line
        == f"{me}:{_line_of('the planted branch')} (`if longest > 8:  # the planted branch`)"
    )
    assert (
        branch.shared
        == f"{me}:{_line_of('before the branch')} (`out.mul_(1.0)  # before the branch`)"
    )
    then = f"{me}:{_line_of('after the branch')}"
    assert branch.first.startswith(f"nothing, going on to {then}")
    assert branch.second.startswith(f"{me}:{_line_of('one side only')}")
    text = str(report)
    assert f"op {d.site.position} at the branch {branch.line}" in text
    assert f"op {d.site.position} aten::add_" not in text  # the next op is not the place


@pytest.mark.parametrize(
    "runner, tag", [(ElseLeak, "the planted else-branch"), (LoopLeak, "the planted loop")]
)
def test_an_else_arm_and_a_loop_are_named_too(runner, tag):
    w = Workload.tiny()
    with executor(w, attention=w.attention(decode_runner=runner())) as ex:
        report = ex.check_parameterization(kind="full")
    assert not report.ok and {v for d in report.differences for v in d.varied} == {
        "sequence lengths"
    }
    line = f"{__file__}:{_line_of(tag)}"
    assert all(d.branch is not None and d.branch.line.startswith(line) for d in report.differences)
    assert f"the paths part at {line}" in str(report) or f"at the branch {line}" in str(report)


class VerifyLeak(PagedDecodeRunner):
    """Leaks only in steps of several tokens per sequence (speculative verification)."""

    graph_safe = True

    def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
        super().run(q, k, v, out, kv_cache, scale)
        md = self.planned()
        if md.query_lens_host[0] > 1:
            out.add_(torch.zeros(max(int(n) for n in md.seq_lens_host)).sum())  # the leak


def _verify(runner: PagedDecodeRunner | None = None) -> tuple[Workload, dict]:
    w = Workload.tiny(num_blocks=160, max_blocks=8, max_seqs=32)
    kw = {"decode_runner": runner} if runner is not None else {}
    return w, {"buckets": [1, 2, 4, 8, 16, 32], "attention": w.attention(max_query_len=4, **kw)}


def test_multi_token_graphs_are_checked_and_a_clean_model_passes():
    w, kw = _verify()
    with w.executor(backend="cpu", **kw) as ex:
        report = ex.check_parameterization(kind="full")
        assert report.ok, report
        assert [k.key for k in report.keys] == [("full", 4), ("full", 16, 4)]
        (_, k4) = report.keys
        assert k4.varied == ["sequence lengths", "block tables", "batch composition"]
        keys = [k.key for k in ex.check_parameterization(query_lens=[2, 3], sizes=[2]).keys]
        assert keys == [("full", 4, 2), ("full", 6, 3), ("piecewise", 2)]
        with pytest.raises(InputError, match="query_lens holds 5"):
            ex.check_parameterization(query_lens=[5])
        with pytest.raises(InputError, match=r"16 sequences \(a bucket\) of 4 tokens"):
            ex.check_parameterization(sizes=[9], query_lens=[4])
        # by default a size that cannot hold the longest query length checks q = 1 only
        keys = [k.key for k in ex.check_parameterization(sizes=[9], kind="full").keys]
        assert keys == [("full", 16)]
        with pytest.raises(InputError, match="name full graphs"):
            ex.check_parameterization(kind="piecewise", query_lens=[4])


def test_a_leak_of_multi_token_graphs_only_is_found():
    w, kw = _verify(VerifyLeak())
    with w.executor(backend="cpu", **kw) as ex:
        report = ex.check_parameterization(kind="full")
    assert {d.key for d in report.differences} == {("full", 16, 4)}
    d = report.differences[0]
    assert d.site.launch.name == "aten::zeros" and d.varied == ["sequence lengths"]
    assert (d.first, d.second) == ((4,), (32,))

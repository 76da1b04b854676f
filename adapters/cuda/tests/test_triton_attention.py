"""The Triton attention runners against the reference runners (xgraph.runners).

On a GPU the kernels run natively; without one they run in Triton's CPU interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports the kernels), so every
numeric test runs on CPU CI machines that have triton installed; without triton the module
is skipped.
Shapes are kept small: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import random

import pytest
import torch
from xgraph_cuda import attention as cuda_attention

from xgraph.errors import XGraphError
from xgraph.metadata import AttentionInputs, AttentionMetadata
from xgraph.runners import PagedDecodeRunner, PagedPrefillRunner

pytest.importorskip("triton")

from xgraph_cuda import triton_runners
from xgraph_cuda.kernels.prefill import varlen_prefill
from xgraph_cuda.kernels.store import store_kv
from xgraph_cuda.kernels.tiles import tile_table
from xgraph_cuda.triton_runners import (
    AttentionKernelError,
    TritonPagedDecodeRunner,
    TritonVarlenPrefillRunner,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}
F32_TOL = {"rtol": 1e-4, "atol": 1e-4}


class Case:
    """A random paged step: caches NaN wherever no real token lives (unused blocks, the tail
    of each last block, the dummy block), tables shuffled, bucket padding included."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        hq: int = 4,
        hkv: int = 2,
        dim: int = 32,
        block_size: int = 4,
        num_blocks: int = 48,
        pad_seqs: int = 0,
        pad_tokens: int = 3,
        width: int | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        pad_query_len: int = 1,
    ) -> None:
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        bs, free = block_size, list(range(num_blocks))
        rng.shuffle(free)
        self.tables, slots = [], []
        for ql, sl in zip(query_lens, seq_lens):
            row = [free.pop() for _ in range(-(-sl // bs))]
            self.tables.append(row)
            slots += [row[p // bs] * bs + p % bs for p in range(sl - ql, sl)]
        self.free = free  # blocks nobody uses: NaN
        width = width or max(len(r) for r in self.tables)
        n = sum(query_lens)
        rows = n + pad_tokens + pad_seqs * pad_query_len
        step = AttentionInputs(query_lens, seq_lens, self.tables, slots)
        if pad_seqs:  # a decode graph's view: padded sequences at the dummy block
            step = step.padded(
                len(query_lens) + pad_seqs, rows, num_blocks * bs, num_blocks, width, pad_query_len
            )
        self.md = step.metadata(DEVICE, fill_block=num_blocks)
        if not pad_seqs and width > self.md.block_tables.shape[1]:
            self.md.block_tables = _widen(self.md.block_tables, width, num_blocks)
        self.num_tokens = n
        self.q = torch.randn(rows, hq, dim, generator=g).to(DEVICE, dtype)
        self.k = torch.randn(rows, hkv, dim, generator=g).to(DEVICE, dtype)
        self.v = torch.randn(rows, hkv, dim, generator=g).to(DEVICE, dtype)
        # padding rows all write the dummy slot: equal rows keep that race deterministic
        self.k[n:], self.v[n:] = self.k[rows - 1], self.v[rows - 1]
        cache = torch.full((2, num_blocks + 1, bs, hkv, dim), float("nan"))
        for ql, sl, row in zip(query_lens, seq_lens, self.tables):
            for p in range(sl - ql):  # context written by earlier steps
                cache[:, row[p // bs], p % bs] = torch.randn(2, hkv, dim, generator=g)
        self.cache = cache.to(DEVICE, dtype)
        self.scale = dim**-0.5


def _widen(table: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    out = torch.full((table.shape[0], width), fill, dtype=torch.int32, device=table.device)
    out[:, : table.shape[1]] = table
    return out


def _run(runner, case: Case, md: AttentionMetadata | None = None):  # type: ignore[no-untyped-def]
    cache = case.cache.clone()
    out = torch.full_like(case.q, 5.0)  # padding rows must come back zeroed (prefill)
    runner.plan(md or case.md)
    runner.run(case.q, case.k, case.v, out, (cache[0], cache[1]), case.scale)
    return out, cache


def _same_cache(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# -- store ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_store_writes_the_first_n_rows_like_index_copy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.zeros(2, 9, 4, 2, 32, dtype=dtype).to(DEVICE)
    k = torch.randn(7, 2, 32, generator=g).to(DEVICE, dtype)
    v = torch.randn(7, 2, 32, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(36, generator=g)[:7].to(DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, 2, 32).index_copy_(0, slots[:5], k[:5])
    want_v.view(-1, 2, 32).index_copy_(0, slots[:5], v[:5])
    store_kv(k, v, (kc, vc), slots, 5)  # rows 5, 6 are padding: never stored
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


# -- decode --------------------------------------------------------------------------------

DECODE_LENS = [7, 1, 13, 4, 21]


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa2", "mha"])
@pytest.mark.parametrize("splits", [1, 3, None], ids=["splits1", "splits3", "auto"])
@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "three-launches"])
def test_decode_matches_the_reference(
    heads: tuple[int, int], splits: int | None, fused: bool
) -> None:
    case = Case([1] * 5, DECODE_LENS, hq=heads[0], hkv=heads[1], pad_seqs=2, pad_tokens=0)
    want, want_cache = _run(PagedDecodeRunner(), case)
    got, got_cache = _run(TritonPagedDecodeRunner(splits, fused=fused), case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **F32_TOL)
    _same_cache(got_cache, want_cache)


def test_fused_decode_is_one_launch_and_bitwise_repeatable(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Store, split attention and merge in one launch (no store or merge kernel), the
    splits merged in split order: two runs give the same bits, the counts are back at 0."""
    from xgraph_cuda.kernels import arena
    from xgraph_cuda.kernels import decode as decode_kernels

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a second launch")

    monkeypatch.setattr(triton_runners, "store_kv", refuse)
    monkeypatch.setattr(decode_kernels, "_merge", refuse)
    case = Case([1] * 5, DECODE_LENS, pad_seqs=1, pad_tokens=0)
    a, cache_a = _run(TritonPagedDecodeRunner(4, fused=True), case)
    b, cache_b = _run(TritonPagedDecodeRunner(4, fused=True), case)
    assert torch.equal(a, b)
    _same_cache(cache_a, cache_b)
    assert int(arena.counts(DEVICE).abs().sum()) == 0
    torch.testing.assert_close(a, _run(PagedDecodeRunner(), case)[0], **F32_TOL)


@pytest.mark.parametrize("splits", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_key_tile_before_the_wait_changes_no_bit(monkeypatch, splits, dtype) -> None:  # type: ignore[no-untyped-def]
    """XGRAPH_CUDA_DECODE_PRELOAD moves where each program loads its first key tile (before
    its PDL wait, so before the step's own k and v are stored), not what it reads: the
    tile is patched with the stored row where its slot is the store's. The own slots start
    as NaN, so a stale tile would show. Contexts put the own position in the first tile and
    past it, and leave splits with empty shares. The interpreter has no wait, so the test
    asks for the preload without it: the same kernel body, less the wait."""
    import functools

    from xgraph_cuda.kernels import decode as decode_kernels

    lens = [7, 1, 70, 33, 21]
    case = Case([1] * 5, lens, pad_seqs=1, pad_tokens=0, num_blocks=64, dtype=dtype)
    outs = {}
    for preload in (True, False):
        launch = functools.partial(decode_kernels.paged_decode, preload=preload)
        monkeypatch.setattr(triton_runners, "paged_decode", launch)
        outs[preload] = _run(TritonPagedDecodeRunner(splits, fused=True), case)
    (a, cache_a), (b, cache_b) = outs[True], outs[False]
    assert torch.isfinite(a[: case.num_tokens]).all()
    assert torch.equal(a, b)
    _same_cache(cache_a, cache_b)


def test_the_decode_preload_needs_the_wait_and_a_store(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Off by the switch; by default where the PDL wait is compiled in, the launch stores the
    step's keys and its programs are fewer than the SMs."""
    from xgraph_cuda.kernels import decode as decode_kernels

    monkeypatch.delenv("XGRAPH_CUDA_DECODE_PRELOAD", raising=False)
    assert decode_kernels.decode_preload() is True
    preloads = decode_kernels.preloads
    assert preloads(True, True, 64, 132)  # batch 8 of 8 kv heads on an H100
    assert not preloads(True, True, 512, 132)  # batch 64: the launch fills the SMs alone
    assert not preloads(False, True, 8, 132) and not preloads(True, False, 8, 132)
    monkeypatch.setenv("XGRAPH_CUDA_DECODE_PRELOAD", "off")
    assert decode_kernels.decode_preload() is False
    assert not preloads(True, True, 8, 132)


def test_the_decode_launches_follow_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(triton_runners.DECODE_ENV, "split")
    assert not TritonPagedDecodeRunner().fused
    monkeypatch.setenv(triton_runners.DECODE_ENV, "auto")
    assert TritonPagedDecodeRunner().fused
    monkeypatch.setenv(triton_runners.DECODE_ENV, "merged")
    with pytest.raises(XGraphError, match="XGRAPH_CUDA_DECODE='merged'"):
        TritonPagedDecodeRunner()


@pytest.mark.parametrize(
    "dim,dtype", [(64, torch.bfloat16), (80, torch.bfloat16), (64, torch.float16)]
)
def test_decode_16_bit_and_other_head_dims(dim: int, dtype: torch.dtype) -> None:
    case = Case([1] * 3, [9, 2, 17], dim=dim, block_size=8, dtype=dtype, pad_tokens=0)
    want, want_cache = _run(PagedDecodeRunner(), case)
    got, got_cache = _run(TritonPagedDecodeRunner(2), case)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    _same_cache(got_cache, want_cache)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_reads_nothing_past_seq_len(splits: int) -> None:
    """A 16-block table whose entries past each context point at NaN blocks gives the exact
    output of a table just wide enough: the kernel never looks past seq_len, so its work
    follows the context, not the table width."""
    case = Case([1] * 3, [5, 9, 2], width=16, num_blocks=64, pad_tokens=0)
    nan_blocks = torch.tensor(case.free[: 16 * 3], dtype=torch.int32, device=DEVICE)
    wide = case.md.block_tables.clone()
    for i, row in enumerate(case.tables):
        wide[i, len(row) :] = nan_blocks[i * 16 : i * 16 + 16 - len(row)]
    narrow = case.md.block_tables[:, :3].clone()
    outs = []
    for table in (wide, narrow):
        md = AttentionMetadata(**{**vars(case.md), "block_tables": table})
        outs.append(_run(TritonPagedDecodeRunner(splits), case, md)[0])
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], _run(PagedDecodeRunner(), case)[0], **F32_TOL)


@pytest.mark.parametrize("q", [2, 3, 5])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pad_seqs", [0, 2])
def test_multi_token_decode_is_causal_inside_the_step(q: int, splits: int, pad_seqs: int) -> None:
    """Speculative verification: q tokens per sequence, token j seeing positions up to its
    own. The kernel matches the reference decode runner and the prefill runner (which plans
    each sequence's causal mask on the host), with a graph's padded sequences (their rows
    read dummy-block positions nothing wrote, NaN here, and are discarded: only the real
    rows are compared)."""
    lens = [q + 6, q, q + 12, q + 3]
    case = Case([q] * 4, lens, pad_seqs=pad_seqs, pad_tokens=0, pad_query_len=q)
    want, want_cache = _run(PagedDecodeRunner(), case)
    got, got_cache = _run(TritonPagedDecodeRunner(splits), case)
    n = case.num_tokens
    assert torch.isfinite(got[:n]).all()
    torch.testing.assert_close(got[:n], want[:n], **F32_TOL)
    _same_cache(got_cache, want_cache)
    torch.testing.assert_close(got[:n], _run(PagedPrefillRunner(), case)[0][:n], **F32_TOL)


def test_a_token_count_that_is_no_multiple_of_the_sequences_is_refused() -> None:
    case = Case([2] * 3, [4, 5, 6], pad_tokens=0)
    md = AttentionMetadata(**{**vars(case.md), "num_seqs": 4})
    with pytest.raises(AttentionKernelError, match="6 query tokens for 4 sequences"):
        _run(TritonPagedDecodeRunner(1), case, md)


def test_auto_splits_follow_shapes_only() -> None:
    assert triton_runners.auto_splits(programs=512, max_context=8192, sms=132, block_n=64) == 1
    assert triton_runners.auto_splits(programs=8, max_context=512, sms=132, block_n=64) == 4
    assert triton_runners.auto_splits(programs=8, max_context=4096, sms=132, block_n=64) == 32
    assert triton_runners.auto_splits(programs=8, max_context=16, sms=132, block_n=64) == 1
    # powers of two only: few distinct kernel binaries across the buckets
    assert triton_runners.auto_splits(programs=64, max_context=4096, sms=132, block_n=64) == 4
    splits = {triton_runners.auto_splits(8 * b, 4096, 132, 64) for b in range(1, 513)}
    assert splits == {1, 2, 4, 8, 16, 32}


def test_decode_tiles_follow_shapes_only() -> None:
    tiles = triton_runners.decode_tiles
    # a 512-token table at 1 / 8 sequences of 8 kv heads: shares of two 64-key tiles
    assert tiles(programs=8, splits=4, max_context=512, sms=132) == (32, 1)
    assert tiles(programs=64, splits=4, max_context=512, sms=132) == (64, 1)
    # every program a sequence's whole context, or long shares: as tuned before
    assert tiles(programs=512, splits=1, max_context=512, sms=132) == (64, 2)
    assert tiles(programs=64, splits=4, max_context=4096, sms=132) == (64, 2)
    assert tiles(programs=128, splits=2, max_context=512, sms=132) == (64, 2)


# -- prefill -------------------------------------------------------------------------------

MIXED = ([5, 3, 1, 20], [5, 11, 9, 20])  # fresh prompt, chunk after context, decode, long


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa2", "mha"])
def test_prefill_matches_the_reference(heads: tuple[int, int]) -> None:
    case = Case(*MIXED, hq=heads[0], hkv=heads[1], pad_tokens=5)
    want, want_cache = _run(PagedPrefillRunner(), case)
    got, got_cache = _run(TritonVarlenPrefillRunner(), case)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **F32_TOL)
    assert torch.count_nonzero(got[case.num_tokens :]) == 0
    _same_cache(got_cache, want_cache)


@pytest.mark.parametrize(
    "dim,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float16)]
)
def test_prefill_16_bit(dim: int, dtype: torch.dtype) -> None:
    case = Case(*MIXED, dim=dim, block_size=16, dtype=dtype, pad_tokens=2)
    want, want_cache = _run(PagedPrefillRunner(), case)
    got, got_cache = _run(TritonVarlenPrefillRunner(), case)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)
    assert torch.count_nonzero(got[case.num_tokens :]) == 0
    _same_cache(got_cache, want_cache)


def test_prefill_kernel_with_several_tiles_per_sequence() -> None:
    """16-row tiles over 16-key blocks: whole unmasked key tiles, masked diagonal tiles and
    tails, chunks after context and a non-power-of-two head dim."""
    case = Case([40, 33, 2], [45, 33, 30], dim=48, block_size=8, num_blocks=24, pad_tokens=17)
    want, _ = _run(PagedPrefillRunner(), case)
    ref_md = case.md
    tiles = tile_table(ref_md.query_lens_host, ref_md.seq_lens_host, 16).to(DEVICE)
    assert tiles.shape[0] == 3 + 3 + 1
    cache = case.cache.clone()
    store_kv(case.k, case.v, (cache[0], cache[1]), ref_md.slot_mapping, case.num_tokens)
    out = torch.full_like(case.q, 5.0)
    varlen_prefill(
        case.q,
        (cache[0], cache[1]),
        tiles,
        ref_md.seq_lens,
        ref_md.block_tables,
        out,
        case.num_tokens,
        case.scale,
        16,
        16,
        4,
        1,
    )
    torch.testing.assert_close(out, want, **F32_TOL)


def test_mixed_step_is_one_store_and_one_attention_launch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = {"store": 0, "attend": 0}

    def spy(name, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(triton_runners, "store_kv", spy("store", triton_runners.store_kv))
    monkeypatch.setattr(
        triton_runners, "varlen_prefill", spy("attend", triton_runners.varlen_prefill)
    )
    case = Case([8] * 16, [8 + i for i in range(16)], num_blocks=96, dim=16, pad_tokens=0)
    got, _ = _run(TritonVarlenPrefillRunner(), case)
    assert calls == {"store": 1, "attend": 1}
    torch.testing.assert_close(got, _run(PagedPrefillRunner(), case)[0], **F32_TOL)


def test_tile_table_rows_heaviest_first() -> None:
    t = tile_table([40, 3, 16], [45, 10, 16], 16).tolist()
    # (sequence, query start, query length, tile offset), by keys visited: 45, 37, 21, 16, 10
    assert t == [[0, 0, 40, 32], [0, 0, 40, 16], [0, 0, 40, 0], [2, 43, 16, 0], [1, 40, 3, 0]]
    assert tile_table([], [], 64).shape == (0, 4)


# -- checks and wiring ---------------------------------------------------------------------


def test_runners_refuse_what_the_kernels_cannot_take() -> None:
    case = Case([1, 1], [3, 4], hq=3, hkv=2, pad_tokens=0)
    runner = TritonPagedDecodeRunner()
    with pytest.raises(AttentionKernelError, match="multiple of kv heads"):
        _run(runner, case)
    with pytest.raises(AttentionKernelError, match="num_splits"):
        TritonPagedDecodeRunner(num_splits=0)
    with pytest.raises(XGraphError, match="before plan"):
        TritonVarlenPrefillRunner().run(case.q, case.k, case.v, case.q, (case.k, case.k), 1.0)


def test_attention_choice_follows_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(cuda_attention.ATTENTION_ENV, "torch")
    assert set(cuda_attention.attention_runners()) == {"prefill"}
    monkeypatch.setenv(cuda_attention.ATTENTION_ENV, "triton")
    runners = cuda_attention.attention_runners()
    assert isinstance(runners["decode"], TritonPagedDecodeRunner)
    assert isinstance(runners["prefill"], TritonVarlenPrefillRunner)
    monkeypatch.setenv(cuda_attention.ATTENTION_ENV, "fastest")
    with pytest.raises(XGraphError, match="auto, triton, torch"):
        cuda_attention.attention_runners()


# -- GPU only ------------------------------------------------------------------------------


@needs_cuda
def test_backend_hands_out_the_triton_runners(backend, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(cuda_attention.ATTENTION_ENV, raising=False)
    runners = backend.kernels().attention
    assert isinstance(runners["decode"], TritonPagedDecodeRunner)
    assert runners["decode"].graph_safe and not runners["prefill"].graph_safe


@needs_cuda
@pytest.mark.parametrize("splits", [1, None])
def test_decode_records_into_a_cuda_graph_and_follows_new_metadata(splits: int | None) -> None:
    """Captured once on one step's buffers, replayed after new lengths, tables and slots are
    written into them: the replay attends the new step."""
    first = Case([1] * 4, [3, 9, 1, 14], pad_tokens=0, seed=1)
    later = Case([1] * 4, [12, 2, 7, 5], pad_tokens=0, seed=2, width=first.md.block_tables.shape[1])
    md, runner = first.md, TritonPagedDecodeRunner(splits)
    cache = later.cache.clone()
    q, k, v, out = first.q.clone(), first.k.clone(), first.v.clone(), torch.empty_like(first.q)
    runner.plan(md)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        runner.run(q, k, v, out, (cache[0], cache[1]), first.scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.run(q, k, v, out, (cache[0], cache[1]), first.scale)
    cache.copy_(later.cache)
    for name in ("seq_lens", "block_tables", "slot_mapping"):
        getattr(md, name).copy_(getattr(later.md, name))
    for dst, src in ((q, later.q), (k, later.k), (v, later.v)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _run(PagedDecodeRunner(), later)[0], **F32_TOL)


@needs_cuda
def test_verification_steps_run_as_full_graphs_through_the_triton_runner(backend) -> None:  # type: ignore[no-untyped-def]
    """q = 2..5 tokens per sequence through the executor on the GPU: full graphs keyed by q,
    several q in one executor, each step equal to the prefill runner's eager result."""
    from xgraph.models import Workload

    ex_w, ref_w = (
        Workload.tiny(device=backend.device, num_blocks=160, max_blocks=8, max_seqs=32)
        for _ in range(2)
    )
    for w in (ex_w, ref_w):
        w.randomize_cache(5)
    ex = ex_w.executor(
        backend=backend, buckets=[1, 2, 4, 8, 16, 32], attention=ex_w.attention(max_query_len=5)
    )
    assert isinstance(ex.decode_runner, TritonPagedDecodeRunner)
    rng = random.Random(5)
    for q, n in [(2, 3), (3, 5), (4, 2), (5, 3), (2, 3), (5, 2)]:
        step = ex_w.step(rng, [q] * n, [rng.randint(q, 30) for _ in range(n)])
        out = ex(**step.kwargs())
        ref = ref_w.eager(step, runner=PagedPrefillRunner())
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)  # logits, several layers
        for a, b in zip(ex_w.cache.tensors(), ref_w.cache.tensors()):
            b.copy_(a)  # the next step starts from the same cache
    s = ex.stats()
    assert s["eager"] == {} and all(k[0] == "full" for k in s["keys"])
    assert s["hits"][("full", 8, 2)] == 1 and len(s["keys"]) == 5
    ex.close()

"""The CUDA adapter: the conformance suite, plus what only CUDA has (routing, driver errors).

Only torch and xgraph are imported here at module level, so the file imports (and its tests
skip) on machines without a GPU, cuda-python or a CUDA build of torch.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

import xgraph
from xgraph.pool import SharedPhysicalPool
from xgraph.testing import ConformanceSuite

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class TestCUDAConformance(ConformanceSuite):
    backend_name = "cuda"
    busy_width, busy_depth = 4096, 24  # replays that keep an H200 busy for milliseconds

    @pytest.fixture(
        params=[("create", 1), ("create", 3), ("map", 2), ("access", 2), ("reserve", 1)]
    )
    def driver_failure(self, request):  # type: ignore[no-untyped-def]
        return request.param

    @pytest.fixture
    def inject_driver_failure(self, monkeypatch):  # type: ignore[no-untyped-def]
        """The n-th cuMem call of a kind returns CUDA_ERROR_OUT_OF_MEMORY, in the driver."""
        from cuda.bindings import driver as cu

        calls = {
            "create": "cuMemCreate",
            "map": "cuMemMap",
            "access": "cuMemSetAccess",
            "reserve": "cuMemAddressReserve",
        }

        @contextlib.contextmanager
        def inject(kind: str, nth: int):  # type: ignore[no-untyped-def]
            call = calls[kind]
            real, seen = getattr(cu, call), {"n": 0}

            def failing(*args):  # type: ignore[no-untyped-def]
                seen["n"] += 1
                if seen["n"] == nth:
                    oom = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY
                    return (oom,) if kind in ("map", "access") else (oom, None)
                return real(*args)

            monkeypatch.setattr(cu, call, failing)
            try:
                yield
            finally:
                monkeypatch.setattr(cu, call, real)

        return inject


@needs_cuda
def test_routed_pool_places_capture_segments_in_the_address_space(backend) -> None:  # type: ignore[no-untyped-def]
    vm = backend.virtual_memory()
    live = vm.live()
    physical = SharedPhysicalPool(vm)
    space = physical.new_space()
    pool = backend.new_pool(segments=space)
    graph = backend.new_graph()
    dev = backend.device
    x = torch.randn(64, 256, device=dev)
    w = torch.randn(256, 512, device=dev)
    with torch.no_grad():
        with backend.warmup_context():
            (x @ w).relu()
        backend.synchronize()
        graph.capture_begin(pool)
        try:
            y = (x @ w).relu()
        except BaseException:
            graph.abort()
            raise
        graph.capture_end()
    start, end = y.data_ptr(), y.data_ptr() + y.numel() * y.element_size()
    assert space.base <= start and end <= space.base + space.size, (hex(start), hex(space.base))
    assert pool.reserved_bytes() == space.cursor > 0
    for _ in range(3):
        x.copy_(torch.randn(64, 256))
        graph.replay()
        backend.synchronize()
        torch.testing.assert_close(y, (x @ w).relu(), rtol=1e-5, atol=1e-5)
    graph.reset()
    del y
    pool.close()
    assert pool.reserved_bytes() == 0  # torch gave every segment back through the allocator
    physical.close()
    assert vm.live() == live


@needs_cuda
def test_failed_capture_leaves_no_capture_and_the_pool_usable(backend) -> None:  # type: ignore[no-untyped-def]
    dev = backend.device
    x = torch.randn(32, device=dev)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return t * t.sum().item()  # a host read: refused before CUDA sees it

    pool, graph = backend.new_pool(), backend.new_graph()
    with torch.no_grad():
        forward(x)
        backend.synchronize()
        graph.capture_begin(pool)
        with pytest.raises(xgraph.CaptureError, match="_local_scalar_dense"):
            forward(x)
        graph.abort()
    assert not graph.capturing
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(backend.capture_stream()):
        assert not torch.cuda.is_current_stream_capturing()
    # the same graph object and the same pool capture again
    with torch.no_grad():
        graph.capture_begin(pool)
        y = x * 3
        graph.capture_end()
    x.fill_(2)
    graph.replay()
    backend.synchronize()
    assert torch.equal(y.cpu(), torch.full((32,), 6.0))
    graph.reset()
    del y
    pool.close()


@needs_cuda
def test_driver_failure_carries_the_driver_error_name(backend) -> None:  # type: ignore[no-untyped-def]
    vm = backend.virtual_memory()
    huge = (1 << 50) // vm.granularity * vm.granularity  # passes every check, no device has it
    with pytest.raises(xgraph.VirtualMemoryError) as info:
        vm.create(huge)
    assert info.value.call == "cuMemCreate"
    assert info.value.error in ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE")
    assert info.value.error in str(info.value)
    assert vm.live()["chunks"] == 0


def _paged_case(device: torch.device, seed: int = 0):  # type: ignore[no-untyped-def]
    """A random paged cache and a 3-sequence step (prefill, chunked prefill, decode-like)."""
    from xgraph.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    num_blocks, bs, hkv, hq, d = 40, 4, 2, 4, 16
    query_lens, seq_lens = [7, 5, 1], [7, 13, 10]
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables, slots = [], []
    for ql, sl in zip(query_lens, seq_lens):
        row = [blocks.pop() for _ in range(-(-sl // bs))]
        tables.append(row)
        slots += [row[p // bs] * bs + p % bs for p in range(sl - ql, sl)]
    n, padded = sum(query_lens), sum(query_lens) + 3
    md = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=device)
    q = torch.randn(padded, hq, d, generator=g).to(device)
    k = torch.randn(padded, hkv, d, generator=g).to(device)
    v = torch.randn(padded, hkv, d, generator=g).to(device)
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(device)
    assert n < padded
    return md, q, k, v, cache


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_sdpa_prefill_runner_matches_the_reference(device: str) -> None:
    from xgraph_cuda.attention import SDPAPrefillRunner

    from xgraph.runners import PagedPrefillRunner

    dev = torch.device(device)
    md, q, k, v, cache = _paged_case(dev)
    outs, caches = [], []
    for runner in (PagedPrefillRunner(), SDPAPrefillRunner()):
        c = cache.clone()
        out = torch.full_like(q, 5.0)  # padding rows must come back zeroed
        runner.plan(md)
        runner.run(q, k, v, out, (c[0], c[1]), q.shape[-1] ** -0.5)
        outs.append(out)
        caches.append(c)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(caches[1], caches[0])
    assert torch.count_nonzero(outs[1][md.num_tokens :]) == 0

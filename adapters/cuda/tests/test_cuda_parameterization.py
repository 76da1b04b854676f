"""The parameterization check on CUDA: kernel nodes read through cuda-python (xgraph_cuda.nodes).

On the GPU: the nodes of a captured graph (function name, grid, block, the non-pointer
argument bytes); a Triton kernel whose grid comes from a Python int of the longest sequence
and a torch kernel whose element count does are flagged by name and field; the reference
model (the adapter's Triton runners) passes for both graph kinds and the check keeps
nothing. Without a GPU: the driver-call checks and the pointer masking (cuda-bindings
imports without a driver).
"""

from __future__ import annotations

import pytest
import torch

import xgraph
from xgraph.errors import XGraphError
from xgraph.models import Workload
from xgraph.runners import PagedDecodeRunner
from xgraph.testing.parameterization import LongestSequenceLeak

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BUCKETS = [1, 2, 4, 8]


def _workload() -> Workload:
    return Workload.tiny(device="cuda")  # 8 blocks of 4 slots per sequence: longest 32


def _triton_fill():  # type: ignore[no-untyped-def]
    """Triton and a kernel `fill` writing 1.0 over ptr[:n], BLOCK elements a program (the
    test skips without Triton)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def fill(ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(ptr + offs, 1.0, mask=offs < n)

    return triton, fill


# -- without a GPU -------------------------------------------------------------------------


def test_a_call_the_binding_lacks_is_named(monkeypatch):
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver
    from xgraph_cuda import nodes

    monkeypatch.delattr(driver, "cuFuncGetParamInfo")
    d = nodes._Driver()
    assert not d.has("cuFuncGetParamInfo")
    with pytest.raises(XGraphError, match=r"has no cuFuncGetParamInfo.*cuda-bindings >= 12\.4"):
        d.call("cuFuncGetParamInfo", None, 0)


def test_words_that_are_addresses_are_left_out():
    pytest.importorskip("cuda.bindings")
    from xgraph_cuda import nodes

    address = 0x7F00_0000_1000
    blob = (5).to_bytes(8, "little") + address.to_bytes(8, "little") + (7).to_bytes(4, "little")
    assert nodes._words(blob, lambda w: w == address) == [5, "pointer", 7]  # type: ignore[arg-type]


# kernels of leak-free models whose by-value functors and offset calculators differed
# between steps on an H200 (stack bytes in their padding and empty structs)
ATEN_KERNELS = {
    "_ZN2at6native29vectorized_elementwise_kernelILi8ENS0_13BinaryFunctorIN3c108BFloat16ES4_"
    "S4_NS0_15binary_internal10MulFunctorIfEEEESt5arrayIPcLm3EEEEviT0_T1_": 3,
    "_ZN2at6native29vectorized_elementwise_kernelILi4EZNS0_51_GLOBAL__N__b1108092_12_PowKernel"
    "_cu_751192d7_2139629pow_tensor_scalar_kernel_implIffEEvRNS_18TensorIteratorBaseET0_EUlfE_"
    "St5arrayIPcLm2EEEEviS6_T1_": 3,
    "_ZN2at6native27unrolled_elementwise_kernelIZZZNS0_23direct_copy_kernel_cudaERNS_18Tensor"
    "IteratorBaseEENKUlvE1_clEvENKUlvE5_clEvEUlfE_St5arrayIPcLm2EELi4E23TrivialOffsetCalculator"
    "ILi1EjESB_NS0_6memory12LoadWithCastILi1EEENSC_13StoreWithCastILi1EEEEEviT_T0_T2_T3_T4_T5_": 7,
}


def test_only_the_builtin_arguments_of_aten_kernels_are_compared():
    from xgraph_cuda import nodes

    for name, count in ATEN_KERNELS.items():  # the element count, then classes by value
        assert nodes.builtin_parameters(name, count) == [True] + [False] * (count - 1)
        assert nodes.builtin_parameters(name, count + 1) is None  # the driver's count rules
    assert nodes.builtin_parameters("_paged_decode_kernel", 9) is None  # Triton: by size
    assert nodes.builtin_parameters("_Z6kernelPfi", 2) is None  # no return type spelled


# -- on the GPU ------------------------------------------------------------------------------


@needs_cuda
def test_the_kernel_nodes_of_a_captured_graph_are_read(backend):
    g = backend.new_graph()
    assert g.keep_launches()
    x = torch.ones(1 << 16, device="cuda")
    y = torch.empty_like(x)
    torch.mul(x, 3.0, out=y)  # warm-up
    with xgraph.graph(g):
        torch.mul(x, 3.0, out=y)
    (k,) = [la for la in g.launches() if la.kind == "kernel"]
    cfg = dict(k.config)
    assert "elementwise" in k.name and cfg["grid"][0] > 1 and cfg["block"][0] > 1
    assert 1 << 16 in cfg.values()  # the element count, a non-pointer argument
    assert "struct of 16 bytes" in cfg.values()  # ATen's functor by value: its size only
    g.reset()


@needs_cuda
def test_the_pointer_and_scalar_arguments_of_a_triton_kernel_are_read(backend):
    _, fill = _triton_fill()
    x = torch.zeros(1000, device="cuda")
    fill[(8,)](x, 1000, BLOCK=128)  # warm-up: compiled before the capture
    g = backend.new_graph()
    assert g.keep_launches()
    with xgraph.graph(g):
        fill[(8,)](x, 1000, BLOCK=128)
    (k,) = [la for la in g.launches() if la.kind == "kernel"]
    cfg = dict(k.config)
    assert "fill" in k.name and cfg["grid"] == (8, 1, 1)
    assert cfg["arg 0"] == "pointer" and cfg["arg 1"] == 1000
    g.reset()


@needs_cuda
def test_a_triton_grid_from_the_longest_sequence_is_flagged(backend):
    triton, fill = _triton_fill()

    class TritonGridLeak(PagedDecodeRunner):
        graph_safe = True
        scratch = torch.zeros(4096, device="cuda")

        def run(self, q, k, v, out, kv_cache, scale):  # type: ignore[no-untyped-def]
            super().run(q, k, v, out, kv_cache, scale)
            longest = max(int(n) for n in self.planned().seq_lens_host)
            fill[(triton.cdiv(longest, 8),)](self.scratch, longest, BLOCK=8)  # the leak

    w = _workload()
    ex = w.executor(
        backend=backend, buckets=BUCKETS, attention=w.attention(decode_runner=TritonGridLeak())
    )
    report = ex.check_parameterization(kind="full")
    ex.close()
    print(report)
    assert {d.site.launch.name for d in report.differences} == {"fill"}
    grids = [d for d in report.differences if d.field == "grid"]
    assert len(grids) == w.model.config.num_layers
    assert (grids[0].first, grids[0].second) == ((1, 1, 1), (4, 1, 1))
    assert grids[0].varied == ["sequence lengths"]
    assert f"kernel {grids[0].site.position} fill" in str(report)


@needs_cuda
def test_a_torch_kernel_whose_size_follows_the_longest_sequence_is_flagged(backend):
    w = _workload()
    runner = LongestSequenceLeak()
    ex = w.executor(backend=backend, buckets=BUCKETS, attention=w.attention(decode_runner=runner))
    report = ex.check_parameterization(kind="full")
    ex.close()
    print(report)
    grids = [d for d in report.differences if d.field == "grid" and d.site.launch.kind == "kernel"]
    assert grids and all(d.first < d.second for d in grids)  # 1024 -> 32768 elements
    assert {v for d in report.differences for v in d.varied} == {"sequence lengths"}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_model_passes_and_nothing_is_kept(backend, dtype):
    w = Workload.tiny(device="cuda", dtype=dtype)
    ex = w.executor(backend=backend, buckets=[1, 2, 4, 8, 16, 32, 64])
    ex.capture([8], kind="full", progress=False)
    stats, books = ex.stats(), backend.virtual_memory().live()
    report = ex.check_parameterization(sizes=[4, 64])
    print(report)
    assert report.ok, str(report)
    assert [k.key[0] for k in report.keys] == ["full", "full", "piecewise", "piecewise"]
    assert ex.stats() == stats and backend.virtual_memory().live() == books
    ex.close()

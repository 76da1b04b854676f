"""The projections' entry (xgraph_cuda.kernels.prefetch): how much of its weights a program
asks L2 for, that the ask is off where it cannot run, and, compiled for Hopper, that the
ask comes before the PDL wait (and the early release before the wait where asked for)."""

import pytest
import torch

pytest.importorskip("triton")

from sm90 import ptx_of
from xgraph_cuda.kernels import prefetch

from xgraph.adapter import XGraphError


def test_share_is_the_whole_slice_where_the_matrix_fits():
    assert prefetch.share(total=8 << 20, per=512, block_k=128, budget=16 << 20) == 512


def test_share_is_the_fitting_fraction_in_whole_tiles():
    # 200 MiB against a 16 MiB budget: 8% of a 4096-column share, rounded down to 128s
    assert prefetch.share(200 << 20, 4096, 128, 16 << 20) == 256
    # never less than one tile
    assert prefetch.share(10 << 30, 4096, 128, 16 << 20) == 128


def test_no_ask_off_the_gpu_or_when_switched_off(monkeypatch):
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    cols, opts = prefetch.options(w, 256, 128, waits=False)
    assert cols == 0 and opts["PREFETCH"] is False
    assert opts["LINE"] == 64  # 128-byte lines of bf16
    monkeypatch.delenv("XGRAPH_CUDA_PREFETCH", raising=False)
    assert prefetch.mode() == "off"
    monkeypatch.setenv("XGRAPH_CUDA_PREFETCH", "on")
    assert prefetch.mode() == "on"
    assert prefetch.options(w, 256, 128, waits=False)[0] == 0  # on, but not on the GPU
    monkeypatch.setenv("XGRAPH_CUDA_PREFETCH", "bogus")
    assert prefetch.mode() == "off"


def test_early_or_end_release_is_an_explicit_choice(monkeypatch):
    monkeypatch.delenv("XGRAPH_CUDA_PDL_TRIGGER", raising=False)
    assert prefetch.trigger() == 0
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "early")
    assert prefetch.trigger() == 1
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "end")
    assert prefetch.trigger() == 2
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "bogus")
    assert prefetch.trigger() == 0


# what the projection kernels share: 16 padded rows, 128-column K steps, PDL on
_COMMON = {"BLOCK_M": 16, "BLOCK_K": 128, "NORM": True, "MMA": True, "EVEN": True}
_COMMON.update(UPCAST=False, PRECISION="tf32", PDL=True, LINE=64)
_BF16 = "*bf16"


def _variant(pre: bool, early: bool, preload: int = 0) -> tuple[dict, dict]:
    const = _COMMON | {"BLOCK_N": 64, "SPLIT": 2, "GATED": False, "RESIDUAL": True}
    const.update(PREFETCH=pre, TRIGGER=int(early), PRELOAD=preload)
    types = {n: _BF16 for n in ("X", "W", "Y", "R", "G")}
    types.update(Part="*fp32", Count="*i32", eps="fp32")
    return const, types


@pytest.fixture(scope="module")
def ptx_order():
    variants = {
        "ask": _variant(True, False),
        "early": _variant(True, True),
        "none": _variant(False, False),
        "preload": _variant(False, False, 1),
        "preload2": _variant(False, False, 2),
        "preload4": _variant(False, False, 4),
    }
    ptx = ptx_of("xgraph_cuda.kernels.gemv", "_gemv_kernel", variants)
    marks = {
        "ask": "prefetch.global.L2",
        "wait": "griddepcontrol.wait",
        "release": "griddepcontrol.launch_dependents",
    }
    out = {name: {k: p.find(m) for k, m in marks.items()} for name, p in ptx.items()}
    for name, p in ptx.items():  # global loads before the wait
        out[name]["loads"] = p[: out[name]["wait"]].count("ld.global")
    return out


def test_weights_are_asked_for_before_the_wait(ptx_order):
    ask = ptx_order["ask"]
    assert 0 <= ask["ask"] < ask["wait"] < ask["release"]


def test_end_release_comes_after_the_product():
    """TRIGGER 2: the release after the wait and after the K loop's last multiply."""
    const, types = _variant(False, False)
    end = {"end": (const | {"TRIGGER": 2}, types)}
    p = ptx_of("xgraph_cuda.kernels.gemv", "_gemv_kernel", end)["end"]
    wait, release = p.find("griddepcontrol.wait"), p.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < release and p.count("griddepcontrol.launch_dependents") == 1
    last_multiply = max(p.rfind("mma.sync"), p.rfind("wgmma.mma_async"))
    assert 0 <= last_multiply < release


def test_early_release_comes_before_the_wait(ptx_order):
    early = ptx_order["early"]
    assert 0 <= early["ask"] < early["release"] < early["wait"]


def test_no_ask_compiled_in_without_prefetch(ptx_order):
    none = ptx_order["none"]
    assert none["ask"] == -1 and 0 <= none["wait"] < none["release"]


def test_preload_loads_the_first_weight_tile_before_the_wait(ptx_order):
    assert ptx_order["none"]["loads"] == 0  # nothing before the wait without it
    assert ptx_order["preload"]["loads"] > 0 and ptx_order["preload"]["ask"] == -1


def test_preload_of_n_tiles_loads_n_times_as_much_before_the_wait(ptx_order):
    assert ptx_order["preload2"]["loads"] == 2 * ptx_order["preload"]["loads"]
    assert ptx_order["preload4"]["loads"] == 4 * ptx_order["preload"]["loads"]


def _qkv_variant(preload: int) -> tuple[dict, dict]:
    const = _COMMON | {"HQ": 16, "HKV": 8, "HALF": 64, "SPLIT": 4}
    const.update(PREFETCH=False, TRIGGER=0, PRELOAD=preload)
    types = {n: _BF16 for n in ("X", "W", "Y", "G", "QW", "KW")}
    types.update(CS="*fp32", Part="*fp32", Count="*i32", eps="fp32", head_eps="fp32")
    return const, types


def test_qkv_preload_loads_both_halves_first_tiles_before_the_wait():
    ptx = ptx_of(
        "xgraph_cuda.kernels.qkv",
        "_qkv_kernel",
        {
            "off": _qkv_variant(0),
            "on": _qkv_variant(1),
            "two": _qkv_variant(2),
            "four": _qkv_variant(4),
        },
    )
    before = {k: p[: p.find("griddepcontrol.wait")].count("ld.global") for k, p in ptx.items()}
    assert before["off"] == 0 and before["on"] > 0 and before["two"] == 2 * before["on"]
    assert before["four"] == 4 * before["on"]


def test_preload_is_two_tiles_for_a_short_slice_unless_switched(monkeypatch):
    monkeypatch.delenv("XGRAPH_CUDA_PRELOAD", raising=False)
    assert prefetch.preload() is None  # auto: by the slice
    w = torch.zeros(64, 4096, dtype=torch.bfloat16)
    assert prefetch.options(w, 256, 128, waits=True)[1]["PRELOAD"] == 2
    assert prefetch.options(w, 512, 128, waits=True)[1]["PRELOAD"] == 2  # four tiles
    assert prefetch.options(w, 640, 128, waits=True)[1]["PRELOAD"] == 1  # five
    assert prefetch.options(w, 128, 128, waits=True)[1]["PRELOAD"] == 1  # all it walks
    assert prefetch.options(w, 256, 128, waits=False)[1]["PRELOAD"] == 0  # no wait
    top = prefetch.PRELOAD_TILES
    cases = [("off", 0, 0), ("0", 0, 0), ("on", 1, 1), ("2", 2, 2), ("3", 2, 3), (str(top), 2, top)]
    for mode, short, long in cases:
        monkeypatch.setenv("XGRAPH_CUDA_PRELOAD", mode)
        assert prefetch.options(w, 256, 128, waits=True)[1]["PRELOAD"] == short, mode
        assert prefetch.options(w, 4096, 128, waits=True)[1]["PRELOAD"] == long, mode
    monkeypatch.setenv("XGRAPH_CUDA_PRELOAD", "2")  # never more tiles than it walks
    assert prefetch.options(w, 128, 128, waits=True)[1]["PRELOAD"] == 1


@pytest.mark.parametrize("value", ["5", "true", "of", "-1", "two", "\u00b2"])
def test_a_preload_value_it_does_not_know_is_refused_by_name(monkeypatch, value):
    from xgraph_cuda import linear as cuda_linear

    monkeypatch.setenv("XGRAPH_CUDA_PRELOAD", value)
    with pytest.raises(XGraphError, match=r"XGRAPH_CUDA_PRELOAD=.*auto.*off.*from 0 to 4"):
        prefetch.preload()
    monkeypatch.delenv(cuda_linear.LINEAR_ENV, raising=False)
    monkeypatch.delenv(cuda_linear.FUSED_ENV, raising=False)
    for choose in (cuda_linear.linear_kernel, cuda_linear.fused_kernel):  # when the kernels
        with pytest.raises(XGraphError, match="XGRAPH_CUDA_PRELOAD="):  # are chosen
            choose()


def _decode_variant(preload: bool) -> tuple[dict, dict]:
    const = {"GROUP": 2, "PAGE": 16, "SPLITS": 4, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128}
    const.update(HEAD_DIM=128, UPCAST=False, PRECISION="tf32", QLEN=1, STORE=True, FIXUP=True)
    const.update(PDL=True, PRELOAD=preload)
    types = {n: _BF16 for n in ("Q", "K", "V", "Out", "Knew", "Vnew")}
    types.update(Part="*fp32", Lse="*fp32", SeqLens="*i32", Tables="*i32", Slots="*i64")
    types.update(Count="*i32", scale_log2="fp32")
    return const, types


def test_decode_preload_reads_the_first_key_tile_before_the_wait():
    """Compiled for sm_90: without the preload nothing is loaded before the PDL wait; with
    it the length, the table entries and the first keys and values are."""
    ptx = ptx_of(
        "xgraph_cuda.kernels.decode",
        "_decode_kernel",
        {"off": _decode_variant(False), "on": _decode_variant(True)},
    )
    before = {k: p[: p.find("griddepcontrol.wait")].count("ld.global") for k, p in ptx.items()}
    assert all(p.find("griddepcontrol.wait") > 0 for p in ptx.values())
    assert before["off"] == 0 and before["on"] > 0

"""A projection's binaries for every row count compiled together on its first call
(xgraph_cuda/family.py): which calls it compiles, once per kind, and when it stands aside.
The compiles themselves need a GPU (Triton's interpreter compiles nothing); here a recorder
stands in for them and for Triton's AsyncCompileMode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from xgraph_cuda import family, pdl, projection
from xgraph_cuda.kernels.tuning import MAX_ROWS

from xgraph.fusion import Fusion, HeadNorm

K, N, D = 64, 96, 32
# the kernels serve CUDA tensors, or CPU ones in Triton's interpreter (CI's runs)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Mode:
    """AsyncCompileMode's shape: entered around the compiles, given the executor."""

    entered: list = []

    def __init__(self, executor) -> None:  # type: ignore[no-untyped-def]
        self.executor = executor

    def __enter__(self):  # type: ignore[no-untyped-def]
        _Mode.entered.append(self.executor)
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        return None


@pytest.fixture
def calls(monkeypatch):  # type: ignore[no-untyped-def]
    """The compiles `compile_family` asks for, as (rows, weight, fusion)."""
    monkeypatch.setattr(family, "_done", set())
    monkeypatch.setattr(family, "_async_mode", lambda: _Mode)
    monkeypatch.setattr(family, "interpreting", lambda: False)
    _Mode.entered = []
    seen: list = []

    def compile_one(x, w, f):  # type: ignore[no-untyped-def]
        assert projection.serves(x, w, f)  # each is a call the kernels take
        seen.append((x.shape[0], w, f))

    return seen, compile_one


def _stream(m: int) -> tuple[torch.Tensor, torch.Tensor, Fusion]:
    x, w = torch.randn(m, K, device=DEVICE), torch.randn(N, K, device=DEVICE)
    norm = torch.ones(K, device=DEVICE)
    return x, w, Fusion(norm=norm, residual=torch.randn(m, N, device=DEVICE))


def test_the_first_call_compiles_every_row_count_and_later_calls_nothing(calls):
    seen, compile_one = calls
    x, w, f = _stream(3)
    family.compile_family(x, w, f, compile_one)
    rows = [m for m, _, _ in seen]
    assert rows == sorted({*family.ROWS, 3}) and max(rows) <= MAX_ROWS
    assert len(_Mode.entered) == 1  # all of them in one pool, waited for together
    for m, ww, ff in seen:  # each call as m rows would make it: per-row tensors resized
        assert ww is w and ff.residual.shape == (m, N) and ff.norm is f.norm
    seen.clear()
    for m in (1, 8, 64):
        xm, _, fm = _stream(m)
        family.compile_family(xm, w, fm, compile_one)
    assert seen == []  # one kind: compiled once


def test_another_kind_compiles_its_own(calls):
    seen, compile_one = calls
    x, w, f = _stream(2)
    family.compile_family(x, w, f, compile_one)
    n = len(seen)
    other = torch.randn(N + 32, K, device=DEVICE)  # another shape
    family.compile_family(x, other, Fusion(), compile_one)
    assert len(seen) == 2 * n
    with pdl.enabled_for(True):  # a capture under PDL compiles the binaries with the wait
        family.compile_family(x, w, f, compile_one)
    assert len(seen) == 3 * n


def test_the_rotary_table_is_resized_with_the_rows(calls):
    seen, compile_one = calls
    hq, hkv = 2, 1
    with torch.device(DEVICE):
        x, w = torch.randn(4, K), torch.randn((hq + 2 * hkv) * D, K)
        cs = torch.randn(4, 2, D)
        heads = HeadNorm(torch.ones(D), torch.ones(D), 1e-6, cs, hq, hkv)
        family.compile_family(x, w, Fusion(norm=torch.ones(K), heads=heads), compile_one)
    assert seen and [f.heads.cos_sin.shape for _, _, f in seen] == [(m, 2, D) for m, _, _ in seen]


@pytest.mark.parametrize("why", ["no async mode", "interpreter", "capturing"])
def test_it_stands_aside(calls, monkeypatch, why):
    seen, compile_one = calls
    if why == "no async mode":
        monkeypatch.setattr(family, "_async_mode", lambda: None)
    elif why == "interpreter":
        monkeypatch.setattr(family, "interpreting", lambda: True)
    else:
        monkeypatch.setattr(family, "_capturing", lambda x: True)
    family.compile_family(*_stream(2), compile_one)
    assert seen == [] and _Mode.entered == []


def test_a_real_async_mode_is_found_where_triton_has_one():
    mode = family._async_mode()
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        assert mode is None
    else:
        assert mode is AsyncCompileMode


def test_a_failed_compile_is_logged_and_left_to_the_call(calls, caplog):
    _, _ = calls

    def broken(x, w, f):  # type: ignore[no-untyped-def]
        raise RuntimeError("no such option")

    with caplog.at_level("WARNING", logger="xgraph"):
        family.compile_family(*_stream(2), broken)  # returns: the call compiles its own
    assert "each row count compiles on its first call instead" in caplog.text
    assert "RuntimeError: no such option" in caplog.text

"""A projection call's recipe (projection.py, `kernels.gemv.Recipe`): made at the first call
of its kind and row count, reused after, equal to one made anew, and remade when a knob of
the environment it reads changes.

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py), where PDL is off:
the tests that need its knobs read force the PDL options the GPU would give.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from xgraph_cuda import family, pdl, projection
from xgraph_cuda.kernels import arena

from xgraph.fusion import Fusion, HeadNorm, reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K, HQ, HKV, D = 64, 2, 1, 32


def _t(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _calls(m: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, Fusion]]:
    """A call of each kind a decode layer makes, at m rows (float32: the interpreter's)."""
    x, norm = _t(1, m, K), 1 + _t(2, K, scale=0.1)
    heads = HeadNorm(
        q_weight=1 + _t(3, D, scale=0.1),
        k_weight=1 + _t(4, D, scale=0.1),
        eps=1e-6,
        cos_sin=_t(5, m, 2, D),
        heads=HQ,
        kv_heads=HKV,
    )
    return {
        "qkv": (x, _t(6, (HQ + 2 * HKV) * D, K, scale=0.1), Fusion(norm=norm, heads=heads)),
        "norm": (x, _t(7, 48, K, scale=0.1), Fusion(norm=norm)),
        "gated+residual": (
            _t(8, m, 2 * K),
            _t(9, 40, K, scale=0.1),
            Fusion(gated=True, residual=_t(10, m, 40)),
        ),
    }


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the environment read (`os.environ.get`) from now on."""
    got: set[str] = set()
    environ = type(os.environ)
    get = environ.get

    def recorded(self: object, key: str, default: str | None = None) -> str | None:
        got.add(key)
        return get(self, key, default)

    monkeypatch.setattr(environ, "get", recorded)
    return got


@pytest.fixture
def gpu_pdl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PDL's options as the GPU would give them under a capture that asks for it."""
    options = pdl.launch_options
    monkeypatch.setattr(pdl, "launch_options", lambda _cuda, b=0, a=True: options(True, b, a))
    with pdl.enabled_for(True):
        yield


@pytest.mark.parametrize("name", ["qkv", "norm", "gated+residual"])
def test_a_kind_met_again_reuses_its_recipe_and_gives_the_same_output(name: str) -> None:
    projection.forget()
    x, w, f = _calls(3)[name]
    first = projection.fused(x, w, f)
    assert len(projection._recipes) == 1
    (kept,) = projection._recipes.values()
    again = projection.fused(x, w, f)
    assert list(projection._recipes.values()) == [kept]  # the same object, reused
    assert torch.equal(first, again)
    torch.testing.assert_close(first, reference(x, w, f, F.linear), rtol=1e-4, atol=1e-4)
    projection.fused(*_calls(4)[name])  # another row count: a recipe of its own
    assert len(projection._recipes) == 2


@pytest.mark.parametrize("name", ["qkv", "norm", "gated+residual"])
def test_a_kept_recipe_equals_one_made_now(name: str) -> None:
    projection.forget()
    x, w, f = _calls(5)[name]
    counts = arena.counts(x.device)
    kept = projection._kept_recipe(x, w, f, family.kind(x, w, f), counts)
    assert kept == projection._recipe(x, w, f, projection.config(x, w, f), counts is not None)


@pytest.mark.parametrize("waits", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("name", ["qkv", "norm", "gated+residual"])
def test_a_recipe_reads_no_environment_its_key_leaves_out(
    name: str, waits: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a recipe reads of the environment is in its key (`knobs`), so no kept recipe
    can differ from one made now; with the GPU's PDL options, it reads three."""
    x, w, f = _calls(2)[name]
    if waits:
        request.getfixturevalue("gpu_pdl")
    c = projection.config(x, w, f)
    projection._recipe(x, w, f, c, True)  # what a process reads once (TRITON_INTERPRET) read
    got = _record_reads(monkeypatch)
    projection._recipe(x, w, f, c, True)
    assert got <= set(projection.KNOBS if waits else projection.KNOBS[:1])
    if waits:
        assert {"XGRAPH_CUDA_PDL_TRIGGER", "XGRAPH_CUDA_PRELOAD"} <= got


def test_a_knob_changed_between_calls_takes_effect_at_the_next(
    gpu_pdl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    projection.forget()
    x, w, f = _calls(1)["norm"]
    counts = arena.counts(x.device)

    def kept() -> dict:
        return projection._kept_recipe(x, w, f, family.kind(x, w, f), counts).meta

    monkeypatch.setenv("XGRAPH_CUDA_PRELOAD", "off")
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "late")
    assert (kept()["PRELOAD"], kept()["TRIGGER"]) == (0, 0)
    monkeypatch.setenv("XGRAPH_CUDA_PRELOAD", "on")
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "end")
    assert (kept()["PRELOAD"], kept()["TRIGGER"]) == (1, 2)
    monkeypatch.setenv("XGRAPH_CUDA_PDL_MAX_MIB", "0")  # past the limit: no attribute
    assert "launch_pdl" not in kept() and kept()["PDL"]
    assert len(projection._recipes) == 3


def test_without_a_wait_the_release_point_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel with no PDL wait compiled in never reads TRIGGER: its value stays 0 whatever
    the knob says, so the knob is not part of such a recipe's key."""
    projection.forget()
    x, w, f = _calls(1)["norm"]
    monkeypatch.setenv("XGRAPH_CUDA_PDL_TRIGGER", "end")
    r = projection._recipe(x, w, f, projection.config(x, w, f), True)
    assert r.meta["TRIGGER"] == 0 and not r.meta["PDL"]


def test_forget_drops_every_recipe() -> None:
    projection.fused(*_calls(2)["norm"])
    assert projection._recipes
    projection.forget()
    assert not projection._recipes

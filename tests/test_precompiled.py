"""Forwards compiled ahead of time (xgraph.precompiled, TokenCompiled's `ahead`): a later
process loads them without tracing; they read the live weights; changed model code, a file
of another key and a call their guards refuse all fall back to compiling, never to a stale
result."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from xgraph import precompiled
from xgraph.compile_cache import CompileCache
from xgraph.compiled import Detached, TokenCompiled
from xgraph.errors import XGraphWarning

pytestmark = pytest.mark.skipif(not precompiled.supported(), reason="torch has no aot_compile")

MODULE = textwrap.dedent(
    """
    import torch


    class Block(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x):
            return torch.nn.functional.silu(self.lin(x)) + 1
    """
)

PROCESS = textwrap.dedent(
    """
    import json, sys, warnings, torch
    sys.path.insert(0, sys.argv[2])
    import fwdmod
    from xgraph.compile_cache import CompileCache
    from xgraph.compiled import TokenCompiled
    from xgraph.errors import XGraphWarning

    warnings.simplefilter("always")
    cache = CompileCache.for_model(model_class="t.Block", config={"n": 32},
        dtype=torch.float32, device=torch.device("cpu"), directory=sys.argv[1])
    block = fwdmod.Block(int(sys.argv[3]))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        f = TokenCompiled(block.forward, 64, cache=cache)
        g = torch.Generator().manual_seed(1)
        err = 0.0
        for n in (8, 1, 5):
            x = torch.randn(n, 32, generator=g)
            err = max(err, float((f(x) - block(x)).abs().max()))
    print(json.dumps({"ahead": f.stats()["ahead"], "compiles": f.compiles, "err": err,
                      "warnings": [str(w.message) for w in caught
                                   if issubclass(w.category, XGraphWarning)]}))
    """
)


def _process(tmp_path, seed: int = 0) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{seed}")}
    out = subprocess.run(
        [sys.executable, "-c", PROCESS, str(tmp_path / "xgcc"), str(tmp_path / "src"), str(seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def source(tmp_path):
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "fwdmod.py"
    path.write_text(MODULE)
    return path


@pytest.mark.slow
def test_a_later_process_loads_the_forward_without_compiling(tmp_path, source):
    cold = _process(tmp_path)
    assert cold["ahead"]["compiled"] == ["many", "one"] and cold["ahead"]["loaded"] == []
    assert cold["compiles"] == 2 and cold["err"] < 1e-5
    files = sorted(p.name for p in (tmp_path / "xgcc").iterdir())
    assert [f.split("-", 1)[1] for f in files if "-" in f] == ["ahead-many.xgcc", "ahead-one.xgcc"]
    # a fresh Inductor cache, other weights under the same key: loaded, nothing traced or
    # compiled, and the answers are the new weights' (read live, never kept in the file)
    warm = _process(tmp_path, seed=7)
    assert warm["ahead"]["loaded"] == ["many", "one"] and warm["ahead"]["compiled"] == []
    assert warm["compiles"] == 0 and warm["ahead"]["refused_calls"] == 0
    assert warm["err"] < 1e-5 and warm["warnings"] == []


@pytest.mark.slow
def test_changed_model_code_is_never_loaded(tmp_path, source):
    _process(tmp_path)
    source.write_text(MODULE.replace("+ 1", "+ 2"))  # the same key, other arithmetic
    warm = _process(tmp_path)
    assert warm["ahead"]["loaded"] == [] and warm["ahead"]["compiled"] == ["many", "one"]
    assert warm["err"] < 1e-5  # the new code's answers
    assert len(warm["warnings"]) == 1 and "model's code changed" in warm["warnings"][0]


def _cache(tmp_path) -> CompileCache:
    return CompileCache.for_model(
        model_class="t.F",
        config={},
        dtype=torch.float32,
        device=torch.device("cpu"),
        directory=tmp_path,
    )


def _twice_sin(x):
    return torch.sin(x) * 2


def test_a_call_its_guards_refuse_runs_the_compiled_path(tmp_path):
    """The ahead-of-time function keeps its guards: a float64 call after a float32 one is
    refused and compiled the ordinary way, with the right answer."""
    f = TokenCompiled(_twice_sin, 16, cache=_cache(tmp_path))
    x = torch.linspace(0, 1, 6)
    torch.testing.assert_close(f(x), _twice_sin(x))
    y = x.double()
    torch.testing.assert_close(f(y), _twice_sin(y))
    stats = f.stats()["ahead"]
    assert stats["compiled"] == ["many"] and stats["refused_calls"] == 1
    assert f.compiles == 2 and stats["refusal"]  # the float64 call compiled the other way


def test_no_cache_and_other_compile_options_compile_as_before(tmp_path):
    assert TokenCompiled(_twice_sin, 16).ahead is None  # nowhere to keep it
    assert TokenCompiled(_twice_sin, 16, cache=_cache(tmp_path), ahead=False).ahead is None
    moded = TokenCompiled(_twice_sin, 16, cache=_cache(tmp_path), mode="max-autotune-no-cudagraphs")
    assert moded.ahead is None  # options the ahead path would not honour
    off = _cache(tmp_path)
    off.directory = None  # the cache turned off
    assert TokenCompiled(_twice_sin, 16, cache=off).ahead is None


def test_a_compiled_forward_pickles_to_its_name_alone():
    """torch's ahead-of-time compile snapshots the objects its guards read, and a model's
    forward may hold its TokenCompiled: that must pickle, and carry no compiled code."""
    f = TokenCompiled(_twice_sin, 16, name="fwd")
    back = pickle.loads(pickle.dumps(f))
    assert isinstance(back, Detached) and back.name == "fwd" and vars(back) == {"name": "fwd"}


def test_the_guard_filter_keeps_what_serializes():
    class Entry:
        def __init__(self, kind, derived=(), name="x", local=False):
            self.guard_type, self.derived_guard_types, self.name = kind, derived, name
            self.orig_guard = type("G", (), {"_unserializable": local})()

    entries = [
        Entry("TENSOR_MATCH"),
        Entry("ID_MATCH"),
        Entry("BUILTIN_MATCH", derived=("ID_MATCH",)),
        Entry("TYPE_MATCH", local=True),
        Entry("SEQUENCE_LENGTH", name="f.__closure__[0].cell_contents.__defaults__"),
        Entry("SEQUENCE_LENGTH", name="G['mod']._local.stack"),
    ]
    assert precompiled.keep_guards(entries) == [True, False, False, False, False, True]


def test_stale_sources_name_what_changed(tmp_path, source, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    import fwdmod

    try:
        first = fwdmod.Block.forward.__code__.co_firstlineno
        assert precompiled._defined_at("fwdmod")[first] == "Block.forward"
        last = first + 2
        digest = precompiled._lines_digest("fwdmod", first, last)
        row = ["fwdmod", first, last, digest, "Block.forward"]
        assert precompiled.stale_sources([row]) == []
        assert precompiled.stale_sources([[*row[:3], "0" * 64, row[4]]]) == [
            f"fwdmod:{first}-{last}"
        ]
        assert precompiled.stale_sources([["no_such_module", *row[1:]]]) == [
            f"no_such_module:{first}-{last}"
        ]
        # the same file, the method replaced at run time (a kernel library's patch)
        monkeypatch.setattr(fwdmod.Block, "forward", lambda self, x: x)
        assert precompiled.stale_sources([row]) == ["fwdmod.Block.forward (replaced at run time)"]
    finally:
        sys.modules.pop(fwdmod.__name__, None)


def test_a_payload_of_another_format_is_refused():
    header = json.dumps({"format": 99, "sources": []}).encode()
    payload = len(header).to_bytes(4, "little") + header
    with pytest.raises(Exception, match="format is 99"):
        precompiled.load(payload)


def test_a_torch_that_gates_the_feature_behind_its_flag(tmp_path, monkeypatch):
    """torch 2.11 attaches aot_compile only under torch._dynamo.config.enable_aot_compile
    (off by default there): xgraph sets it for its own compiles and loads only."""
    monkeypatch.setattr(torch._dynamo.config, "enable_aot_compile", False)
    precompiled.supported.cache_clear()
    try:
        assert precompiled.supported()
        f = TokenCompiled(_twice_sin, 16, cache=_cache(tmp_path))
        x = torch.linspace(0, 1, 6)
        torch.testing.assert_close(f(x), _twice_sin(x))
        assert f.stats()["ahead"]["compiled"] == ["many"]
        assert torch._dynamo.config.enable_aot_compile is False  # set back
        g = TokenCompiled(_twice_sin, 16, cache=_cache(tmp_path))  # loads what f kept
        torch.testing.assert_close(g(x), _twice_sin(x))
        assert g.stats()["ahead"]["loaded"] == ["many"] and g.compiles == 0
    finally:
        precompiled.supported.cache_clear()


def test_a_forward_that_cannot_be_kept_serves_this_process_alone(tmp_path, monkeypatch):
    """torch cannot serialize it: this process runs what it compiled, warned once; other
    token classes compile the ordinary way, and nothing is written."""

    def refuse(compiled):
        raise TypeError("cannot pickle 'Thing' object")

    monkeypatch.setattr(precompiled, "dump", refuse)
    f = TokenCompiled(_twice_sin, 16, cache=_cache(tmp_path))
    x = torch.linspace(0, 1, 6)
    with pytest.warns(XGraphWarning, match="cannot be kept compiled ahead of time"):
        torch.testing.assert_close(f(x), _twice_sin(x))
    torch.testing.assert_close(f(x[:1]), _twice_sin(x[:1]))  # one token: the ordinary path
    stats = f.stats()["ahead"]
    assert stats["compiled"] == ["many"] and "Thing" in stats["unsaved"]
    assert stats["off"] is None and f.compiles == 2
    assert not any("ahead" in p.name for p in tmp_path.iterdir())

"""The per-machine compile cache: keying, where it lives, bad files ignored, and a round trip
between two processes (the second compiles nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from xgraph import compile_cache as cc
from xgraph.compile_cache import CompileCache, cache_directory
from xgraph.errors import XGraphWarning


def _cache(tmp_path, **over):
    args = dict(
        model_class="m.Model",
        config={"hidden_size": 64, "num_layers": 2},
        dtype=torch.float32,
        device=torch.device("cpu"),
        settings={"backend": "inductor", "dynamic": True},
        directory=tmp_path,
    )
    args.update(over)
    return CompileCache.for_model(**args)


def test_the_key_follows_model_dtype_settings_and_versions(tmp_path, monkeypatch):
    base = _cache(tmp_path)
    assert base.key == _cache(tmp_path).key  # the same model and setup: the same file
    others = [
        _cache(tmp_path, dtype=torch.bfloat16),
        _cache(tmp_path, config={"hidden_size": 128, "num_layers": 2}),
        _cache(tmp_path, model_class="m.Other"),
        _cache(tmp_path, settings={"backend": "inductor", "dynamic": False}),
    ]
    real = cc._versions()
    monkeypatch.setattr(cc, "_versions", lambda: {**real, "torch": "9.9.9"})
    others.append(_cache(tmp_path))
    monkeypatch.setattr(cc, "_versions", lambda: {**real, "xgraph": "0.0.0"})
    others.append(_cache(tmp_path))
    keys = {c.key for c in others}
    assert len(keys) == len(others) and base.key not in keys
    assert base.path == tmp_path / f"{base.key}.xgcc"


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.ENV, str(tmp_path / "env"))
    assert cache_directory() == tmp_path / "env"
    assert cache_directory(tmp_path / "arg") == tmp_path / "arg"  # an argument wins
    assert cache_directory(False) is None
    assert cache_directory("off") is None
    monkeypatch.setenv(cc.ENV, "off")
    assert cache_directory() is None
    assert _cache(None).path is None and not _cache(None).load() and not _cache(None).save()
    monkeypatch.delenv(cc.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == tmp_path / "xdg" / "xgraph" / "compile"


def test_no_file_is_a_miss_without_a_warning(tmp_path):
    c = _cache(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.load() is False
    assert c.stats()["loaded"] is False and c.problem is None


@pytest.mark.parametrize("bad", ["not-ours", "truncated", "corrupt-artifacts"])
def test_a_bad_file_is_ignored_with_one_warning(tmp_path, bad):
    c = _cache(tmp_path)
    content = {
        "not-ours": b"garbage",
        "truncated": cc.MAGIC + b"\xff\xff\x00\x00{",
        "corrupt-artifacts": _with_fields(c, b"not what save_cache_artifacts writes"),
    }[bad]
    c.path.write_bytes(content)
    with pytest.warns(XGraphWarning, match="compiling as if it were absent"):
        assert c.load() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second load is quiet
        assert c.load() is False
    assert c.problem and not c.loaded


def _with_fields(c: CompileCache, payload: bytes, fields=None) -> bytes:
    header = json.dumps(fields if fields is not None else c.fields, sort_keys=True).encode()
    return cc.MAGIC + len(header).to_bytes(4, "little") + header + payload


def test_a_file_of_another_model_is_never_loaded(tmp_path, monkeypatch):
    c = _cache(tmp_path)
    other = _cache(tmp_path, dtype=torch.bfloat16)
    c.path.write_bytes(_with_fields(c, b"", fields=other.fields))  # copied under c's name
    loads = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loads.append)  # never called
    with pytest.warns(XGraphWarning, match="another model's or setup's"):
        assert c.load() is False
    assert loads == []


def test_an_eager_backend_writes_nothing(tmp_path):
    from xgraph.compiled import TokenCompiled

    c = _cache(tmp_path)
    f = TokenCompiled(lambda x: x * 2, 8, backend="eager", cache=c)
    assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))
    assert list(tmp_path.iterdir()) == [] and not c.saved


_PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import counters
    from xgraph.compile_cache import CompileCache
    from xgraph.compiled import TokenCompiled

    cache = CompileCache.for_model(model_class="t.F", config={"n": 32}, dtype=torch.float32,
                                   device=torch.device("cpu"), directory=sys.argv[1])
    f = TokenCompiled(lambda x, w: torch.nn.functional.silu(x @ w) + 1, 64, cache=cache,
                      ahead=False)  # the artifacts alone (tests/test_precompiled.py: ahead)
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    y = f(x, w)
    print(json.dumps({"stats": cache.stats(), "sum": float(y.sum()),
                      "inductor": dict(counters["inductor"])}))
    """
)


def _run(tmp_path, inductor_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir)}
    out = subprocess.run(
        [sys.executable, "-c", _PROCESS, str(tmp_path / "xgcc")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    """Two processes with empty torch caches of their own: the first compiles and saves, the
    second loads the file and compiles nothing (Inductor's FX graph cache hits)."""
    cold = _run(tmp_path, "inductor-cold")
    assert cold["stats"]["saved"] and not cold["stats"]["loaded"]
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1
    warm = _run(tmp_path, "inductor-warm")  # a fresh torch cache: only the xgraph file helps
    assert warm["stats"]["loaded"] and warm["stats"]["key"] == cold["stats"]["key"]
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert warm["sum"] == cold["sum"]

"""`xgraph generate --compile-cache DIR|off`: where the compiled decoder is kept for the next
process (xgraph.compile_cache), from the command line."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from hf_tiny import tiny

from xgraph.cli import main as xgraph_main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-llama-cache"))
    tiny("llama", seed=5).save_pretrained(path)
    return path


def _generate(folder: str, *extra: str) -> int:
    args = ["generate", "--model", folder, "--prompt", "1 2 3", "--max-new-tokens", "3"]
    return xgraph_main([*args, "--backend", "cpu", "--ignore-eos", "--compile", *extra])


@pytest.mark.slow
def test_generate_keeps_the_compiled_decoder_in_the_folder_given(folder, tmp_path, caplog):
    where = tmp_path / "cache"
    assert _generate(folder, "--compile-cache", str(where)) == 0
    files = sorted(p.name for p in where.iterdir())
    assert all(f.endswith(".xgcc") for f in files)
    # torch.compile's artifacts, and the decoder compiled ahead of time per token class
    kinds = sorted(f[:-5].split("-", 1)[1] if "-" in f else "artifacts" for f in files)
    assert kinds == ["ahead-many", "ahead-one", "artifacts"]
    with caplog.at_level(logging.INFO, logger="xgraph"):
        assert _generate(folder, "--compile-cache", str(where)) == 0  # a later process: loads
    assert any("compile cache: loaded" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in where.iterdir()) == files


@pytest.mark.slow
def test_generate_compile_cache_off_writes_nothing(folder, tmp_path, monkeypatch):
    env = tmp_path / "env"  # the default folder: off must not fall back to it
    monkeypatch.setenv("XGRAPH_COMPILE_CACHE", str(env))
    assert _generate(folder, "--compile-cache", "off") == 0
    assert not env.exists() or not any(env.iterdir())

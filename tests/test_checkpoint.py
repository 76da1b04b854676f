"""A Qwen3-shaped model's seeded random weights written as a Hugging Face checkpoint: the
reference model and transformers read the same weights `init_random` draws."""

from __future__ import annotations

import json

import pytest
import torch

from xgraph.models import Qwen3Config, Qwen3Model
from xgraph.models.checkpoint import write_checkpoint
from xgraph.models.qwen3 import draws, hf_parameters

pytest.importorskip("safetensors")


def _weights(model: Qwen3Model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "cache" not in k}


def test_the_checkpoint_holds_init_randoms_weights(tmp_path):
    nbytes = write_checkpoint("tiny", str(tmp_path), torch.float32, seed=3)
    assert nbytes == (tmp_path / "model.safetensors").stat().st_size > 0
    drawn = Qwen3Model.build("tiny", num_blocks=4, seed=3)
    read = Qwen3Model.build("tiny", num_blocks=4, weights=str(tmp_path))
    a, b = _weights(drawn), _weights(read)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert Qwen3Config.from_hf(str(tmp_path)) == Qwen3Config.named("tiny")


def test_a_16_bit_checkpoint_holds_the_draws_rounded(tmp_path):
    from safetensors.torch import load_file

    write_checkpoint("tiny", str(tmp_path), torch.bfloat16)
    got = load_file(str(tmp_path / "model.safetensors"))
    want = dict(draws(Qwen3Config.named("tiny"), 0))
    assert [n for n, _ in hf_parameters(Qwen3Config.named("tiny"))] == list(want)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["torch_dtype"] == "bfloat16"


def test_transformers_reads_the_same_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_checkpoint("tiny", str(tmp_path), torch.float32, seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    params = dict(model.named_parameters())
    for name, t in draws(Qwen3Config.named("tiny"), 1):
        assert torch.equal(params[name].detach(), t), name
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied

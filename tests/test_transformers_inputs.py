"""Mistakes a user of the transformers integration makes get the library's own errors.

A broken model folder is a ModelFolderError naming the file, a model that is not a causal
decoder an UnsupportedModelError, prompts or sampling parameters of the wrong shape or
range an InputError saying what is expected, and a config the cache cannot serve is
refused when the GraphModel is built, with the field named: never a raw exception from
safetensors, torch.multinomial or a reshape at the first step.
"""

from __future__ import annotations

import copy
import json
import random
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY, tiny  # noqa: E402

from xgraph import InputError  # noqa: E402
from xgraph.integrations.transformers import (  # noqa: E402
    CapacityError,
    GraphModel,
    ModelFolderError,
    SamplingParams,
    UnsupportedModelError,
)


@pytest.fixture(scope="module")
def gm():
    with GraphModel(tiny("llama"), backend="cpu", **LIMITS) as g:
        yield g


@pytest.fixture
def folder(tmp_path):
    tiny("llama", seed=1).save_pretrained(tmp_path)
    return tmp_path


# -- model folders ----------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupted_safetensors_file_is_named(folder, damage):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "garbage": b"x" * 64, "empty": b""}
    path.write_bytes(damaged[damage])
    with pytest.raises(ModelFolderError, match=rf"{path}.*not a readable safetensors file"):
        GraphModel.from_pretrained(str(folder), backend="cpu")


def test_a_shard_the_index_names_but_the_folder_lacks_is_named(folder):
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    with pytest.raises(ModelFolderError, match=r"missing: \['model-00002.safetensors'\]"):
        GraphModel.from_pretrained(str(folder), backend="cpu")


def test_an_unreadable_config_is_named(folder):
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ModelFolderError, match=r"config\.json cannot be read"):
        GraphModel.from_pretrained(str(folder), backend="cpu")


def test_a_t5_or_gemma2_folder_is_an_unsupported_model(tmp_path):
    t5 = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    with pytest.raises(UnsupportedModelError, match=r"model_type 't5'.*encoder-decoder"):
        GraphModel.from_pretrained(str(tmp_path / "t5"), backend="cpu")
    gemma2 = transformers.Gemma2Config(**TINY)
    transformers.Gemma2ForCausalLM(gemma2).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM.*softcapping"):
        GraphModel.from_pretrained(str(tmp_path / "gemma2"), backend="cpu")


# -- prompts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "says"),
    [
        (torch.tensor([[1, 2, 3], [4, 5, 6]]), r"got a 2-D tensor.*prompts\.tolist\(\)"),
        (torch.tensor([1, 2, 3]), r"got a 1-D tensor"),
        ([1, 2, 3], r"flat list of 3 ints.*Wrap one prompt in a list"),
        ("hello", r"got a string.*Tokenize"),
        (["hello", "world"], r"prompt 0 is a string.*Tokenize"),
        ([[1, 2.5]], r"prompt 0, token 1 is 2\.5; token ids are ints"),
        ([[1, True]], r"prompt 0, token 1 is True"),
        ([[3], [1, 128]], r"prompt 1, token 1 is 128, outside the model's vocabulary \[0, 128\)"),
        ([[3], [-1]], r"prompt 1, token 0 is -1"),
        ([torch.tensor([[1, 2]])], r"prompt 0 is a 2-D torch\.int64 tensor"),
        (7, r"got int"),
    ],
)
def test_prompts_of_the_wrong_shape_or_type_say_what_is_expected(gm, prompts, says):
    with pytest.raises(InputError) as e:
        gm.generate(prompts, 2)
    assert re.search(says, str(e.value)), str(e.value)
    assert gm.stats()["captures"] == 0  # refused before any step


def test_prompts_as_1d_tensors_are_the_same_prompts(gm):
    ps = [[5, 6, 7, 8], [9, 10]]
    assert gm.generate([torch.tensor(p) for p in ps], 3).tokens == gm.generate(ps, 3).tokens


@pytest.mark.parametrize("new", [2.5, "3", [2], None])
def test_max_new_tokens_of_the_wrong_type_is_an_input_error(gm, new):
    with pytest.raises((InputError, CapacityError), match=r"max_new_tokens"):
        gm.generate([[1, 2], [3]], new)  # [2]: one budget for two prompts


# -- sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"temperature": float("nan")}, r"temperature=nan; give a finite number >= 0"),
        ({"temperature": float("inf")}, r"temperature=inf"),
        ({"temperature": -1.0}, r"temperature=-1\.0"),
        ({"temperature": "hot"}, r"temperature='hot'"),
        ({"top_k": -1}, r"top_k=-1; give an int >= 0"),
        ({"top_k": 1.5}, r"top_k=1\.5"),
        ({"top_p": 0.0}, r"top_p=0\.0; give a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1\.5"),
        ({"top_p": float("nan")}, r"top_p=nan"),
        ({"seed": 1.5}, r"seed=1\.5; give an int"),
    ],
)
def test_invalid_sampling_parameters_are_input_errors(fields, says):
    with pytest.raises(InputError, match=says):
        SamplingParams(**fields)


def test_sampling_must_be_sampling_params(gm):
    with pytest.raises(InputError, match=r"give a SamplingParams"):
        gm.generate([[1, 2]], 2, sampling={"temperature": 1.0})


def test_top_p_keeps_the_most_likely_tokens(gm):
    ps = [[4, 8, 15], [16, 23, 42]]
    greedy = gm.generate(ps, 6).tokens
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, seed=3)  # the most likely only
    assert gm.generate(ps, 6, sampling=nucleus).tokens == greedy
    wide = SamplingParams(temperature=5.0, top_p=0.999, seed=3)
    assert gm.generate(ps, 6, sampling=wide).tokens != greedy  # a hot wide nucleus samples


# -- configs the cache cannot serve -----------------------------------------------------


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused_at_construction():
    model = tiny("llama", num_key_value_heads=3)
    with pytest.raises(
        UnsupportedModelError,
        match=r"num_key_value_heads=3, which does not divide num_attention_heads=4",
    ):
        GraphModel(model, backend="cpu", **LIMITS)
    assert model.config._attn_implementation == "sdpa"


class CastingEmbedding(torch.nn.Module):
    """A float64 embedding table handing float32 rows on: the model's first parameter is
    float64, its attention runs in float32."""

    def __init__(self, inner: torch.nn.Embedding) -> None:
        super().__init__()
        self.inner = inner.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids).float()


def test_a_cache_dtype_follows_what_attention_computes():
    model = tiny("llama")
    model.model.embed_tokens = CastingEmbedding(model.model.embed_tokens)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    rng = random.Random(0)
    ps = [[rng.randrange(128) for _ in range(n)] for n in (9, 4)]
    with GraphModel(model, backend="cpu", **LIMITS) as g:
        assert next(model.parameters()).dtype == torch.float64
        assert {t.dtype for t in g.cache.tensors()} == {torch.float32}
        result = g.generate(ps, 4, record_logits=True)
    for p, new, got in zip(ps, result.tokens, result.logits):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([p + new[:-1]])).logits[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_model_cast_after_construction_is_refused_at_its_next_capture():
    model = tiny("llama")
    with GraphModel(model, backend="cpu", **LIMITS) as g:
        model.double()
        with pytest.raises(UnsupportedModelError, match=r"torch\.float64.*holds .* torch\.float32"):
            g.generate([[1, 2, 3]], 2)

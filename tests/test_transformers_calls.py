"""What the probe before the first step finds, family by family and in general.

Each attention call of a forward gets a cache layer of its own (a layer that calls
attention twice, a layer run in a loop, layers of different head sizes), RoBERTa-style
models get the positions their embeddings count, GPT-2 with a pad token runs as graphs,
and attention the paged runners do not compute (bidirectional, a mask of its own) is
refused when the GraphModel is built. Every run is checked, logit by logit, against
transformers' own full-sequence forward.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY  # noqa: E402

from xgraph.integrations.transformers import GraphModel, UnsupportedModelError  # noqa: E402

# TINY without its key/value head count and head size: each family keeps its own
SIZES = {k: v for k, v in TINY.items() if k not in ("num_key_value_heads", "head_dim")}


def build(config_cls: str, model_cls: str, seed: int = 0, **fields: object) -> torch.nn.Module:
    """A tiny model, every weight randomised (zero-initialised gates and biases count)."""
    config = getattr(transformers, config_cls)(**{**SIZES, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def prompts(lens: tuple[int, ...] = (13, 5, 21), seed: int = 0, low: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, 128) for _ in range(n)] for n in lens]


def run_and_compare(model: torch.nn.Module, ps: list[list[int]], **kw: object) -> GraphModel:
    """Generate through a GraphModel (graphs only) and check every logit; returns it closed."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    with GraphModel(model, backend="cpu", on_capture_error="raise", **{**LIMITS, **kw}) as gm:
        result = gm.generate(ps, 6, record_logits=True)
    for p, new, got in zip(ps, result.tokens, result.logits):
        with torch.no_grad():  # the full-sequence forward, no cache: the model's definition
            want = ref(input_ids=torch.tensor([p + new[:-1]]), use_cache=False).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert result.graph_steps["eager"] == 0 and result.graph_steps["full"] > 0
    return gm


# -- more attention calls than layers -----------------------------------------------------


class Looped(torch.nn.Module):
    """A decoder layer run twice per forward, like a looped (recurrent-depth) model: one
    module, one layer_idx, two attention calls with different inputs. (transformers' own
    cache keys by layer_idx too, so only its forward without a cache is the reference.)"""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.attention_type = getattr(inner, "attention_type", "full_attention")

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object):
        return self.inner(self.inner(hidden_states, *args, **kwargs), *args, **kwargs)


def test_a_layer_that_calls_attention_twice_gets_two_cache_layers():
    model = build("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)
    model.model.layers[1] = Looped(model.model.layers[1])
    gm = run_and_compare(model, prompts())
    assert [c.where.split(" (")[1].split(",")[0] for c in gm.calls] == [
        "model.layers.0.self_attn",
        "model.layers.1.inner.self_attn",
        "model.layers.1.inner.self_attn",
    ]
    assert len(gm.cache.layers) == 3  # one per call, not one per layer_idx


def test_diffllama_two_calls_per_layer_with_different_values():
    model = build("DiffLlamaConfig", "DiffLlamaForCausalLM", num_key_value_heads=2)
    gm = run_and_compare(model, prompts())
    assert len(gm.calls) == 2 * model.config.num_hidden_layers


def test_dory_loops_each_get_their_own_cache():
    fields = dict(num_key_value_heads=2, n_input_layers=1, n_recurrent_layers=1)
    model = build("DoryConfig", "DoryForCausalLM", n_output_layers=0, **fields)
    gm = run_and_compare(model, prompts())
    loops = model.config.n_recurrent_loops
    assert len(gm.calls) == model.config.num_hidden_layers + loops - 1


# -- per-layer head sizes -----------------------------------------------------------------


def test_gemma4_per_layer_head_dims_get_cache_layers_of_their_own():
    model = build(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
    )
    gm = run_and_compare(model, prompts())
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert [k.shape[-1] for k, _ in gm.cache.layers] == [16, 32]


# -- positions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config_cls", "model_cls"),
    [
        ("RobertaConfig", "RobertaForCausalLM"),
        ("CamembertConfig", "CamembertForCausalLM"),
        ("XLMRobertaConfig", "XLMRobertaForCausalLM"),
        ("Data2VecTextConfig", "Data2VecTextForCausalLM"),
    ],
)
def test_roberta_style_positions_count_from_padding_idx(config_cls, model_cls):
    model = build(config_cls, model_cls, is_decoder=True)
    pad = model.config.pad_token_id
    ps = prompts(low=pad + 1)
    ps[1][2] = ps[2][0] = ps[2][7] = pad  # padding tokens: position padding_idx, not counted
    run_and_compare(model, ps)


def test_xmod_positions_count_from_padding_idx():
    model = build("XmodConfig", "XmodForCausalLM", is_decoder=True)
    model.set_default_language(model.config.languages[0])
    ps = prompts(low=2)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    # its language adapters index with a boolean mask (a host read): those steps run eagerly
    with GraphModel(model, backend="cpu", **LIMITS) as gm:
        result = gm.generate(ps, 6, record_logits=True)
    for p, new, got in zip(ps, result.tokens, result.logits):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([p + new[:-1]])).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_gpt2_with_a_pad_token_runs_as_graphs():
    model = build("GPT2Config", "GPT2LMHeadModel", pad_token_id=0)
    ps = prompts()
    ps[0][0] = ps[1][-1] = 0  # the pad token first and last: transformers' padding check
    run_and_compare(model, ps)


# -- attention the runners do not compute -------------------------------------------------


class TokenShift(torch.nn.Module):
    """An MLP that mixes each token with the one before it (RWKV-style token shift): the
    forward then depends on other tokens outside attention."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        return self.inner(0.5 * (x + before))


def test_tokens_mixed_outside_attention_are_refused_before_the_first_step():
    model = build("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)
    model.model.layers[0].mlp = TokenShift(model.model.layers[0].mlp)
    with pytest.raises(
        UnsupportedModelError,
        match=r"LlamaForCausalLM.*earlier tokens come through the cache.*outside attention "
        r"mixes tokens",
    ):
        GraphModel(model, backend="cpu", **LIMITS)
    assert model.config._attn_implementation == "sdpa"


def test_bidirectional_attention_is_refused_before_the_first_step():
    model = build("BertConfig", "BertLMHeadModel", is_decoder=False)
    with pytest.raises(
        UnsupportedModelError,
        match=r"BertLMHeadModel.*attention call 0 \(bert\.encoder\.layer\.0\.attention\.self, "
        r"BertSelfAttention\) is bidirectional.*is_decoder=True",
    ):
        GraphModel(model, backend="cpu", **LIMITS)
    assert model.config._attn_implementation == "sdpa"


def test_a_learned_attention_bias_is_refused_before_the_first_step():
    model = build("DogeConfig", "DogeForCausalLM", num_key_value_heads=2)
    assert model.model.layers[0].self_attn.A.abs().sum() > 0  # its bias is not constant
    with pytest.raises(
        UnsupportedModelError,
        match=r"DogeForCausalLM.*\(model\.layers\.0\.self_attn, DogeAttention\) passes an "
        r"attention mask of its own .*not plain causal",
    ):
        GraphModel(model, backend="cpu", **LIMITS)
    assert model.config._attn_implementation != "xgraph"


def test_attention_sinks_are_refused_before_the_first_step():
    model = build("GraniteSWAConfig", "GraniteSWAForCausalLM", num_key_value_heads=2)
    with pytest.raises(UnsupportedModelError, match=r"attention sinks \(s_aux=\)"):
        GraphModel(model, backend="cpu", **LIMITS)

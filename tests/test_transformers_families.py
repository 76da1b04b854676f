"""Every causal-LM family of the installed transformers, with a tiny random config.

For each model type in transformers' causal-LM mapping a tiny config is built from the
family's own config class (small sizes where it has those fields; a family whose config
cannot be made tiny here is skipped with the reason), its weights are randomised (so that
zero-initialised parameters such as gates and biases count), and the model either
- runs through GraphModel, every logit of a multi-sequence chunked-prefill + decode run
  matching transformers' own full-sequence forward, every step a graph replay; or
- is refused with UnsupportedModelError when the GraphModel is built, before any step.
It never runs and differs. The families named in EXPECTED must come out that way.
"""

from __future__ import annotations

import copy
import logging
import random
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import LIMITS, TINY  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from xgraph.integrations.transformers import GraphModel, UnsupportedModelError  # noqa: E402

FAMILY_NAMES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = TINY["vocab_size"]
SIZES = dict(
    TINY,
    # mixtures of experts, kept small
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=0,
    ffn_hidden_size=128,
    # per-layer inputs and wide global layers (Gemma 3n / 4), kept small
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    global_head_dim=32,
    rotary_dim=8,  # GPT-J, CodeGen: within the head
    # decoders of encoder families run causally
    is_decoder=True,
)
TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id")
# per family: config fields the generic sizes do not cover
EXTRA: dict[str, dict] = {
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 0},
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 256,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "dots3_note_text": {"num_key_value_heads": 4},
    "gemma3n_text": {"num_kv_shared_layers": 0, "laurel_rank": 8, "altup_num_inputs": 2},
    "gpt2": {"pad_token_id": 0},  # a pad token set: transformers' padding check
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]]},
    "whisper": {"d_model": 64, "decoder_attention_heads": 4, "encoder_attention_heads": 4},
    "plbart": {"d_model": 64, "decoder_attention_heads": 4, "encoder_attention_heads": 4},
}
MAX_PARAMS = 20e6
LIMITS = dict(LIMITS, max_seqs=2)
PROMPT_LENS = (13, 21)  # 21 > 16: chunked prefill; two sequences: mixed and decode steps
NEW_TOKENS = 4
# family -> "match", or a pattern the refusal must match (the true reason)
EXPECTED = {
    "llama": "match",
    "gpt2": "match",
    "roberta": "match",
    "camembert": "match",
    "xlm-roberta": "match",
    "data2vec-text": "match",
    "xmod": "match",
    "diffllama": "match",
    "dory": "match",
    "hrm_text": "match",
    "doge": r"attention mask of its own .*not plain causal",
    "gemma4_text": "match",
    "dbrx": "match",
    "mpt": r"does not go through transformers' AttentionInterface",
    "bloom": r"does not go through transformers' AttentionInterface",
    # _supports_attention_backend is False, and attention goes through the interface
    "stablelm": "match",
    "biogpt": "match",
    # Moshi's text decoder: its config names the audio and depth models, it holds neither
    "moshi": "match",
    # hybrids: the refusal names the layers that keep a state, and their modules
    "jamba": r"layers \[0, 1\] are linear_attention layers \(JambaMamba\w+\), which keep a",
    "qwen3_next": r"linear_attention layers \(Qwen3NextGatedDeltaNet\), which keep a recurrent",
    "falcon_h1": r"hybrid layers \(FalconH1Mixer\), which keep a recurrent state",
    "mamba": r"linear_attention layers \(MambaBlock\)",
    "rwkv": r"no softmax attention: layers \[0, 1\] are recurrent \(RwkvBlock\)",
    "granite_swa": r"attention sinks",
    "gemma2": r"attn_logit_softcapping",
    "bert": "match",
}


class NoTinyConfig(Exception):
    """The family's config cannot be made tiny here (not a statement about xgraph)."""


def _settable(config: object, name: str) -> bool:
    """A field of the config (a per-layer one too), not a derived read-only property."""
    if isinstance(getattr(type(config), name, None), property):
        return False
    try:
        return hasattr(config, name)
    except Exception:  # per-layer configs refuse a global read of a per-layer field
        return True


def _config(model_type: str) -> object:
    cls = transformers.CONFIG_MAPPING[model_type]
    try:
        base = cls()
    except Exception as exc:
        raise NoTinyConfig(f"default config fails: {type(exc).__name__}: {exc}") from None
    fields = {k: v for k, v in SIZES.items() if _settable(base, k)}
    for name in TOKEN_FIELDS:  # special tokens inside the tiny vocabulary
        value = getattr(base, name, None)
        if isinstance(value, int) and value >= VOCAB:
            fields[name] = 1 + TOKEN_FIELDS.index(name)
    fields.update(EXTRA.get(model_type, {}))
    attempts = [fields]
    types = getattr(base, "layer_types", None)
    if types and _settable(base, "layer_types"):  # lists sized for the default layer count
        attempts.append({**fields, "layer_types": None})
        attempts.append({**fields, "layer_types": list(types)[: SIZES["num_hidden_layers"]]})
    error = None
    for kwargs in attempts:
        try:
            return cls(**kwargs)
        except Exception as exc:
            error = exc
    raise NoTinyConfig(f"no tiny config: {type(error).__name__}: {str(error)[:200]}")


def build_tiny(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model of the family, every weight randomised."""
    config = _config(model_type)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    model_cls = getattr(transformers, name if isinstance(name, str) else name[0])
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in model_cls(config).parameters())
        if params > MAX_PARAMS:
            raise NoTinyConfig(f"{params / 1e6:.0f}M parameters even with a tiny config")
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    except NoTinyConfig:
        raise
    except Exception as exc:
        raise NoTinyConfig(f"cannot build: {type(exc).__name__}: {str(exc)[:200]}") from None
    if hasattr(model, "set_default_language"):  # X-MOD: adapters per language
        model.set_default_language(next(iter(config.languages)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _reference(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    try:
        ref.set_attn_implementation("sdpa")
    except Exception:  # families without sdpa keep their default (eager)
        pass
    return ref


def _skip_if_transformers_fails(ref: torch.nn.Module, prompt: list[int]) -> None:
    """A raw exception from a model whose own forward fails on this config is not xgraph's."""
    try:
        with torch.no_grad():
            ref(input_ids=torch.tensor([prompt]))
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
        raise NoTinyConfig(f"transformers' own forward fails: {failure}") from None


def check_family(model_type: str) -> tuple[str, str]:
    """("match", details) or ("refused", message); AssertionError when it runs and differs."""
    model = build_tiny(model_type)
    ref = _reference(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    try:
        gm = GraphModel(model, backend="cpu", **LIMITS)
    except UnsupportedModelError as exc:
        assert model.config._attn_implementation != "xgraph"  # given back
        return "refused", str(exc)
    except Exception:
        _skip_if_transformers_fails(ref, prompts[0])
        raise
    try:  # a refusal here, after the first step, fails the test
        with gm:
            result = gm.generate(prompts, NEW_TOKENS, record_logits=True)
    except Exception:
        _skip_if_transformers_fails(ref, prompts[0])
        raise
    worst = 0.0
    for p, generated, got in zip(prompts, result.tokens, result.logits):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([p + generated[:-1]])).logits[0].float()
        assert got.shape == want.shape
        worst = max(worst, float((got - want).abs().max()))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation != "xgraph"  # given back by close()
    return "match", f"max |diff| {worst:.1e}, steps {result.graph_steps}"


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_family_matches_transformers_or_is_refused_up_front(model_type, caplog):
    caplog.set_level(logging.ERROR, logger="xgraph")  # the ignored-mask note; restored after
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome, detail = check_family(model_type)
        except NoTinyConfig as exc:
            if model_type in EXPECTED:
                raise
            pytest.skip(str(exc))
    print(f"\n{model_type}: {outcome}: {detail}")
    want = EXPECTED.get(model_type)
    if want == "match":
        assert outcome == "match", detail
    elif want is not None:
        assert outcome == "refused" and re.search(want, detail), detail


# -- the named cases on their own ----------------------------------------------------------

# tiny configs of the families the class flag used to refuse (their own config fields)
TINY_DECODERS = {
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", TINY),
    "biogpt": (
        "BioGptConfig",
        "BioGptForCausalLM",
        {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
        | {"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256},
    ),
}


def _tiny_decoder(family: str) -> torch.nn.Module:
    config_cls, model_cls, fields = TINY_DECODERS[family]
    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases and gates count too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("family", sorted(TINY_DECODERS))
def test_a_flagged_family_generates_what_transformers_generates(family):
    """StableLM and BioGPT say _supports_attention_backend = False, yet their attention
    goes through the AttentionInterface: they run, greedy tokens equal to transformers'."""
    model = _tiny_decoder(family)
    assert not type(model)._supports_attention_backend  # the flag the refusal used to read
    ref = copy.deepcopy(model)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    with GraphModel(model, backend="cpu", **LIMITS) as gm:
        result = gm.generate(prompts, 8)
        assert result.graph_steps["full"] > 0 and result.graph_steps["eager"] == 0
    for prompt, tokens in zip(prompts, result.tokens):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                min_new_tokens=8,  # no stop at the tiny vocabulary's end-of-sequence id
                do_sample=False,
            )[0, len(prompt) :].tolist()
        assert tokens == want


HYBRIDS = {
    # config class, model class, fields over TINY, the layers and modules the refusal names
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2},
        r"layers \[0\] are linear_attention layers \(JambaMambaDecoderLayer\)",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4},
        r"layers \[0\] are linear_attention layers \(Qwen3NextGatedDeltaNet\)",
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16},
        r"layers \[0, 1\] are hybrid layers \(FalconH1Mixer\)",
    ),
}


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_a_hybrid_is_refused_naming_its_state_layers(family):
    config_cls, model_cls, fields, named = HYBRIDS[family]
    config = getattr(transformers, config_cls)(**{**TINY, "num_experts_per_tok": 2, **fields})
    model = getattr(transformers, model_cls)(config).eval()
    with pytest.raises(UnsupportedModelError, match=named) as refused:
        GraphModel(model, backend="cpu", **LIMITS)
    assert "keep a recurrent state" in str(refused.value), refused.value
    assert "_supports_attention_backend" not in str(refused.value)
    assert model.config._attn_implementation != "xgraph"  # never switched, nothing held


def test_a_composite_model_is_refused_and_a_text_decoder_is_not():
    """Gemma 3 with its vision tower is composite (the hint: load the text decoder);
    MoshiForCausalLM names audio and depth models in its config but is the text decoder
    alone, so it runs."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    vision |= dict(num_attention_heads=2, image_size=16, patch_size=8)
    config = transformers.Gemma3Config(
        text_config=TINY, vision_config=vision, mm_tokens_per_image=4
    )
    with pytest.raises(
        UnsupportedModelError, match=r"composite model \(sub-models \['vision_config'\]"
    ):
        GraphModel(
            transformers.Gemma3ForConditionalGeneration(config).eval(), backend="cpu", **LIMITS
        )
    assert check_family("moshi")[0] == "match"

"""The tiny Hugging Face configs the transformers tests share, their cache limits and builder.

Not a test module: the tests import it as `from hf_tiny import ...` (pytest's default
import mode puts tests/ on sys.path), after their `pytest.importorskip("transformers")`.
"""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
LIMITS = dict(block_size=4, max_model_len=64, max_seqs=4, max_num_tokens=16)
# family -> (config class, model class, extra config fields)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # every Mistral layer slides; a window as long as max_model_len is declared exact
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
}


def tiny(family: str, seed: int = 0, **fields: object) -> torch.nn.Module:
    """A tiny model of one of FAMILIES, TINY with `fields` over it, seeded weights, in eval."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **fields})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).eval()

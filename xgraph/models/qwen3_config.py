"""The shape of a Qwen3-style decoder, by name or from a Hugging Face config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from ..errors import InputError

# the Hugging Face config.json name of each field that has another one there
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "max_position": "max_position_embeddings",
}


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position: int = 8192
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        """Refuse a shape the model cannot run, naming the fields (and their config.json
        names), before any weight is made."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (type(v) is not int or v < 1):
                raise InputError(f"Qwen3Config: {_name(f.name)} must be a positive int, got {v!r}.")
        if self.num_heads % self.num_kv_heads:
            raise InputError(
                f"Qwen3Config: {_name('num_heads')} = {self.num_heads} is not a multiple of "
                f"{_name('num_kv_heads')} = {self.num_kv_heads}; grouped-query attention shares "
                "each kv head among the same number of query heads. Choose kv heads that divide "
                "the query heads."
            )
        if self.head_dim % 2:
            raise InputError(
                f"Qwen3Config: head_dim = {self.head_dim} is odd; rotary embeddings rotate pairs "
                "of channels. Use an even head_dim."
            )

    @classmethod
    def tiny(cls) -> Qwen3Config:
        """Small enough for CPU tests: 2 layers, 4 query heads over 2 kv heads."""
        return cls(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position=2048,
        )

    @classmethod
    def qwen3_0_6b(cls) -> Qwen3Config:
        """The shape of Qwen3-0.6B (28 layers, 16 q / 8 kv heads of 128, hidden 1024)."""
        return cls(
            vocab_size=151_936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            max_position=40_960,
        )

    @classmethod
    def qwen3_8b(cls) -> Qwen3Config:
        """The shape of Qwen3-8B (36 layers, 32 q / 8 kv heads of 128, hidden 4096, untied
        embeddings): where the weights, not the launches, set a decode step's time."""
        return cls(
            vocab_size=151_936,
            hidden_size=4096,
            intermediate_size=12_288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            max_position=40_960,
            tie_word_embeddings=False,
        )

    @classmethod
    def named(cls, name: str) -> Qwen3Config:
        table = {n: getattr(cls, f) for n, f in NAMED.items()}
        if name not in table:
            raise ValueError(f"Unknown model config {name!r}; choose one of {sorted(table)}.")
        return table[name]()

    @classmethod
    def from_hf(cls, folder: str) -> Qwen3Config:
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", 1e6),
            max_position=c.get("max_position_embeddings", 8192),
            tie_word_embeddings=c.get("tie_word_embeddings", True),
        )

    def to_hf(self) -> dict:
        """The shape in a Hugging Face config.json's fields (what `from_hf` reads back)."""
        return {HF_NAMES.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}


NAMED = {"tiny": "tiny", "qwen3-0.6b": "qwen3_0_6b", "qwen3-8b": "qwen3_8b"}  # name -> method


def _name(field: str) -> str:
    hf = HF_NAMES.get(field)
    return f"{field} ({hf})" if hf else field

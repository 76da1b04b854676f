"""A Qwen3-shaped model's seeded random weights written as a Hugging Face checkpoint.

`write_checkpoint` writes the weights `Qwen3Model.init_random` loads (`qwen3.draws`: per
checkpoint parameter, in checkpoint order, from one host generator), in a dtype, as a folder
of `model.safetensors` and a `config.json` in Hugging Face's fields (`model_type` "qwen3"),
so `Qwen3Model.build(weights=folder)` and transformers' `from_pretrained(folder)` both read
it: what `xgraph bench startup` times as an engine's checkpoint read, where drawing the
weights in each process would time a host's random number generator instead.
"""

from __future__ import annotations

import json
import os

import torch

from .qwen3 import draws
from .qwen3_config import Qwen3Config

WEIGHTS_FILE = "model.safetensors"


def hf_config(config: Qwen3Config, dtype: torch.dtype) -> dict:
    """config.json of the shape: its fields in Hugging Face's names, as a Qwen3 model."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **config.to_hf(),
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_checkpoint(
    config: Qwen3Config | str, folder: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> int:
    """`draws(config, seed)` in `dtype` written to `folder` (made if missing) as
    model.safetensors and config.json; returns the weight file's bytes. Needs safetensors
    (the `transformers` extra)."""
    from safetensors.torch import save_file  # optional dependency

    if isinstance(config, str):
        config = Qwen3Config.named(config)
    os.makedirs(folder, exist_ok=True)
    state = {name: t.to(dtype) for name, t in draws(config, seed)}
    path = os.path.join(folder, WEIGHTS_FILE)
    save_file(state, path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(config, dtype), f, indent=1)
    return os.path.getsize(path)

"""Loading a model (and its tokenizer, if any) from a local folder: no network, no pickle.

The folder holds what `save_pretrained(..., safe_serialization=True)` writes: config.json
and *.safetensors (one file or shards with an index). transformers is asked for local files
only, for safetensors only (a pickled .bin checkpoint is refused: unpickling runs code) and
without remote code.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .deps import require, require_safetensors
from .errors import ModelFolderError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> Any:
    """A torch dtype, or "auto" (the checkpoint's). None / "auto": float32 on the CPU, where
    half-precision matmuls are slow and the reference checks run; the checkpoint's elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if torch.device(device).type == "cpu" else "auto"
    if dtype not in DTYPES:
        raise ModelFolderError(f"Unknown dtype {dtype!r}; choose one of {[*DTYPES, 'auto']}.")
    return DTYPES[dtype]


def check_folder(folder: str) -> None:
    """Refuse, saying what is missing, a folder that is not a local safetensors checkpoint."""
    if not os.path.isdir(folder):
        raise ModelFolderError(
            f"{folder!r} is not a folder. Pass a local model folder (config.json and "
            "*.safetensors); xgraph does not download models."
        )
    files = os.listdir(folder)
    if "config.json" not in files:
        raise ModelFolderError(
            f"{folder!r} has no config.json; save the model there with "
            "model.save_pretrained(folder)."
        )
    if not any(f.endswith(".safetensors") for f in files):
        pickled = [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
        hint = (
            f" It has {pickled}: pickled weights are not loaded (unpickling runs code); "
            "convert them with model.save_pretrained(folder, safe_serialization=True)."
            if pickled
            else ""
        )
        raise ModelFolderError(f"{folder!r} has no *.safetensors weights.{hint}")


def load_model(
    folder: str, *, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu"
) -> Any:
    """The folder's causal LM, in eval mode without gradients, on `device`."""
    check_folder(folder)
    transformers = require()
    require_safetensors()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=resolve_dtype(dtype, device),
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        attn_implementation="sdpa",  # switched to "xgraph" by GraphModel, restored on close
    )
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(folder: str) -> Any | None:
    """The folder's tokenizer, or None when it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return None
    return require().AutoTokenizer.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False
    )

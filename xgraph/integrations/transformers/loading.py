"""Loading a model (and its tokenizer, if any) from a local folder: no network, no pickle.

The folder holds what `save_pretrained(..., safe_serialization=True)` writes: config.json
and *.safetensors (one file or shards with an index). transformers is asked for local files
only, for safetensors only (a pickled .bin checkpoint is refused: unpickling runs code) and
without remote code. Before transformers builds anything, the config must name a causal
LM (else UnsupportedModelError) and every weights file must open as safetensors (else
ModelFolderError naming the file), so a broken folder never ends in a raw exception.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .deps import require, require_safetensors
from .errors import ModelFolderError, UnsupportedModelError

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


def check_config(folder: str) -> Any:
    """The folder's config, which must be one of a causal LM transformers knows."""
    transformers = require()
    path = os.path.join(folder, "config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # not JSON, no model_type, a model_type it does not know
        raise ModelFolderError(
            f"{path} cannot be read as a transformers config ({type(exc).__name__}: {exc}). "
            "Save the model there with model.save_pretrained(folder)."
        ) from exc
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        kind = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "a"
        raise UnsupportedModelError(
            f"{folder!r} ({type(config).__name__}, model_type {model_type!r})",
            f"it is {kind} model without a causal-LM class in transformers "
            f"{transformers.__version__}; xgraph runs causal decoders "
            "(AutoModelForCausalLM)",
        )
    return config


def check_weights(folder: str) -> None:
    """Every *.safetensors file opens (its header is whole), and an index names files
    that are there: ModelFolderError naming the file otherwise."""
    safetensors = require_safetensors()
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    for name in files:
        path = os.path.join(folder, name)
        try:
            with safetensors.safe_open(path, framework="pt"):
                pass
        except Exception as exc:
            raise ModelFolderError(
                f"{path} is not a readable safetensors file ({exc}); it may be truncated or "
                "corrupted. Copy it again, or re-save the model with "
                "model.save_pretrained(folder)."
            ) from exc
    for index in (f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")):
        path = os.path.join(folder, index)
        try:
            with open(path) as fh:
                shards = set(json.load(fh)["weight_map"].values())
        except Exception as exc:
            raise ModelFolderError(
                f"{path} is not a safetensors index (JSON with a weight_map): {exc}."
            ) from exc
        missing = sorted(shards - set(files))
        if missing:
            raise ModelFolderError(f"{path} names weights files that are missing: {missing}.")


def load_model(
    folder: str, *, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu"
) -> Any:
    """The folder's causal LM, in eval mode without gradients, on `device`."""
    check_folder(folder)
    transformers = require()
    torch_dtype = resolve_dtype(dtype, device)
    check_config(folder)
    check_weights(folder)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch_dtype,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=False,
            # its default attention (sdpa where it has it): GraphModel switches it to
            # "xgraph" and gives it back; a model that cannot switch is refused there
        )
    except Exception as exc:  # weights that do not fit the config, ...
        raise ModelFolderError(
            f"{folder!r}: transformers could not load the model ({type(exc).__name__}: "
            f"{exc}). Check that the weights were saved from this config."
        ) from exc
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(folder: str) -> Any | None:
    """The folder's tokenizer, or None when it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return None
    return require().AutoTokenizer.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False
    )

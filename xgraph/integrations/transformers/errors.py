"""The errors of the transformers integration: each names the model or folder and what to do."""

from __future__ import annotations

from ...errors import XGraphError


class MissingExtraError(XGraphError, ImportError):
    """transformers (or safetensors) is not installed, or not a supported version."""


class UnsupportedModelError(XGraphError):
    """A model xgraph refuses to run: the message names the model and the reason."""

    def __init__(self, model: str, reason: str, hint: str = "") -> None:
        self.model = model
        self.reason = reason
        msg = f"{model} cannot run through xgraph: {reason}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)


class ModelFolderError(XGraphError, ValueError):
    """A model folder that cannot be loaded locally (missing config, no safetensors, ...)."""


class CapacityError(XGraphError):
    """A request that does not fit the KV cache or the sequence limits the model was built with."""

"""The optional dependency: transformers is imported here only, when a function needs it.

Importing `xgraph.integrations.transformers` must work without transformers installed (the
`xgraph` command line imports the integration's sub-command), so every module asks for
the library through `require()` inside the function that uses it.
"""

from __future__ import annotations

from types import ModuleType

from .errors import MissingExtraError

SUPPORTED = ((5, 0), (6, 0))  # [low, high): the AttentionInterface / masking API of 5.x
INSTALL_HINT = "Install the extra: pip install 'xgraph[transformers]'."


def _major_minor(version: str) -> tuple[int, int]:
    parts = [*version.split("."), "0", "0"][:2]
    digits = ["".join(ch for ch in p if ch.isdigit()) or "0" for p in parts]
    return int(digits[0]), int(digits[1])


def require() -> ModuleType:
    """The transformers module, or MissingExtraError saying how to install a supported one."""
    try:
        import transformers
    except ImportError as exc:
        raise MissingExtraError(f"transformers is not installed. {INSTALL_HINT}") from exc
    low, high = SUPPORTED
    if not low <= _major_minor(transformers.__version__) < high:
        raise MissingExtraError(
            f"transformers {transformers.__version__} is installed; the xgraph integration "
            f"needs >={low[0]}.{low[1]},<{high[0]}.{high[1]}. {INSTALL_HINT}"
        )
    return transformers


def require_safetensors() -> ModuleType:
    try:
        import safetensors
    except ImportError as exc:
        raise MissingExtraError(f"safetensors is not installed. {INSTALL_HINT}") from exc
    return safetensors

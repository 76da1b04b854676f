"""Availability of the CUDA backend: a CUDA build of torch, a visible device, cuda-bindings."""

from __future__ import annotations

from importlib import metadata

from xgraph.adapter import Availability


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def availability() -> Availability:
    import torch

    versions = {"torch": torch.__version__}
    if torch.version.cuda is None:
        return Availability(
            False, f"torch {torch.__version__} is a CPU-only build (no CUDA runtime)", versions
        )
    versions["cuda runtime"] = str(torch.version.cuda)
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError as exc:
        return Availability(
            False, f"cuda-python is not importable ({exc}); `pip install cuda-bindings`", versions
        )
    versions["cuda-bindings"] = _version("cuda-bindings") or "?"
    if not torch.cuda.is_available():
        return Availability(
            False, "no CUDA device is visible (torch.cuda.is_available() is False)", versions
        )
    name = torch.cuda.get_device_name()
    return Availability(True, f"{torch.cuda.device_count()} x {name}", versions)

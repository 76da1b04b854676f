"""Availability of the Ascend backend: torch_npu importable and an NPU visible."""

from __future__ import annotations

from importlib import metadata

from xgraph.interfaces import Availability


def availability() -> Availability:
    import torch

    versions = {"torch": torch.__version__}
    try:
        import torch_npu
    except ImportError as exc:
        return Availability(
            False,
            f"torch_npu is not importable ({exc}); install the torch_npu build matching "
            "your CANN toolkit",
            versions,
        )
    try:
        versions["torch_npu"] = metadata.version("torch_npu")
    except metadata.PackageNotFoundError:
        versions["torch_npu"] = getattr(torch_npu, "__version__", "?")
    if not torch.npu.is_available():
        return Availability(
            False, "no NPU is visible (torch.npu.is_available() is False)", versions
        )
    # registration and discovery only so far: never claim a backend that cannot capture
    return Availability(
        False,
        f"{torch.npu.device_count()} NPU(s) found, but xgraph-ascend's NPUGraph and aclrt "
        "virtual-memory support are not implemented yet; use another backend",
        versions,
    )

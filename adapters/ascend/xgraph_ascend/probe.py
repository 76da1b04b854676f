"""Availability of the Ascend backend: torch_npu importable, an NPU visible, the APIs present.

Importing torch_npu can fail in many ways besides "not installed", and some of them are not
ImportErrors: missing CANN libraries (`libhccl.so: cannot open shared object file`), torch's
backend autoload failing (the RuntimeError naming TORCH_DEVICE_BACKEND_AUTOLOAD), a CUDA
build of torch ("Two accelerators cannot be used at the same time"). The probe catches any
exception and names the cause and the fix.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from typing import Any

from xgraph.interfaces import Availability

# what the adapter calls; missing ones mean a torch_npu older than the 7.0.0 branches
REQUIRED = {
    "torch.npu.NPUGraph": ("npu", "NPUGraph"),
    "torch.npu.graph_task_group_begin": ("npu", "graph_task_group_begin"),
    "torch.npu.graph_task_update_begin": ("npu", "graph_task_update_begin"),
    "torch.npu.ExternalEvent": ("npu", "ExternalEvent"),
}
_SO = re.compile(r"(lib[\w.+-]+\.so[\w.]*)")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def explain_import_failure(exc: BaseException, cuda_version: str | None) -> str:
    """Why `import torch_npu` failed, and what to do, from the exception (and its causes)."""
    text = " | ".join(f"{type(e).__name__}: {e}" for e in _chain(exc))
    if isinstance(exc, ModuleNotFoundError) and exc.name == "torch_npu":
        return (
            "torch_npu is not installed; install the torch_npu build that matches your CANN "
            "toolkit and torch version (pip install torch-npu==<torch version>), on a machine "
            "with the CANN runtime"
        )
    if "Two accelerators" in text or cuda_version:
        return (
            f"torch_npu cannot load next to a CUDA build of torch (torch.version.cuda = "
            f"{cuda_version}): install the CPU build of torch that torch_npu pins ({text})"
        )
    if "cannot open shared object file" in text or "libascendcl" in text:
        lib = _SO.search(text)
        return (
            f"the CANN libraries are missing ({lib.group(1) if lib else 'a CANN library'} "
            "cannot be loaded): install the CANN toolkit and source its set_env.sh (e.g. "
            f"/usr/local/Ascend/ascend-toolkit/set_env.sh) before starting Python ({text})"
        )
    if "TORCH_DEVICE_BACKEND_AUTOLOAD" in text:
        return (
            "torch's autoload of the torch_npu backend failed; fix the cause below, or set "
            f"TORCH_DEVICE_BACKEND_AUTOLOAD=0 and import torch_npu explicitly ({text})"
        )
    return f"importing torch_npu failed ({text})"


def _missing_apis(torch: Any) -> list[str]:
    missing = []
    for name, (mod, attr) in REQUIRED.items():
        if not hasattr(getattr(torch, mod, None), attr):
            missing.append(name)
    return missing


def _version(dist: str, module: Any) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "?"))


def availability() -> Availability:
    import torch

    versions = {"torch": torch.__version__}
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # not only ImportError: see the module docstring
        return Availability(False, explain_import_failure(exc, torch.version.cuda), versions)
    versions["torch_npu"] = _version("torch_npu", torch_npu)
    try:
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return Availability(
                False, "no NPU is visible (torch.npu.is_available() is False)", versions
            )
        missing = _missing_apis(torch)
        if missing:
            return Availability(
                False, f"torch_npu {versions['torch_npu']} lacks {', '.join(missing)} (ACL "
                "graphs need torch_npu from the 7.0.0 branches and CANN >= 8.1)", versions,
            )  # fmt: skip
        era = "context" if hasattr(torch_npu.npu.memory, "MemPoolContext") else "owner"
        versions["pool era"] = era
        n, name = torch.npu.device_count(), torch.npu.get_device_name()  # type: ignore[attr-defined]
    except Exception as exc:
        why = f"torch_npu imported but querying the NPU failed: {exc!r}"
        return Availability(False, why, versions)
    return Availability(
        True,
        f"{n} x {name}; {era}-era MemPool (shared-physical "
        f"{'on' if era == 'owner' else 'off: falls back to shared-pool'}); verified against "
        "the simulated runtime only, run adapters/ascend/scripts/hardware_check.py",
        versions,
    )

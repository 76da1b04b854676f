"""Availability of the Ascend backend: torch_npu importable, an NPU visible, the APIs present.

Importing torch_npu can fail in many ways besides "not installed", and some of them are not
ImportErrors: missing CANN libraries (`libhccl.so: cannot open shared object file`), torch's
backend autoload failing (the RuntimeError naming TORCH_DEVICE_BACKEND_AUTOLOAD), a CUDA
build of torch ("Two accelerators cannot be used at the same time"). The probe catches any
exception and names the cause and the fix.

Beyond the graph APIs (runtime.REQUIRED_APIS, the 7.0.0 branches on), the backend needs
`torch_npu._C._npu_from_dlpack` for `as_tensor` (the 7.3.0 branches on: absent from
v2.1.0-7.0.0, v2.5.1-7.0.0, v2.5.1-7.1.0 and v2.6.0-7.2.0). What only FusedDecodeRunner
needs (npu_fused_infer_attention_score and its max-workspace query) is reported as a
capability, `versions["fused decode"]`, and does not make the backend unavailable.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from xgraph.adapter import Availability

from .runtime import torch_npu_facts

_SO = re.compile(r"(lib[\w.+-]+\.so[\w.]*)")

AS_TENSOR_API = "_C._npu_from_dlpack"
FUSED_DECODE_APIS = (
    "npu_fused_infer_attention_score",
    "_npu_fused_infer_attention_score_get_max_workspace",
)


def _has(module: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


def missing_apis(torch_npu: Any) -> list[str]:
    """What the backend needs beyond the graph APIs and this torch_npu lacks."""
    return [] if _has(torch_npu, AS_TENSOR_API) else [f"torch_npu.{AS_TENSOR_API}"]


def fused_decode_support(torch_npu: Any) -> str:
    """Whether FusedDecodeRunner can run on this torch_npu: 'yes', or 'no: why'."""
    lacks = [f"torch_npu.{n}" for n in FUSED_DECODE_APIS if not _has(torch_npu, n)]
    return f"no: this torch_npu lacks {', '.join(lacks)}" if lacks else "yes"


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
    return f"importing torch_npu (or asking it for NPUs) failed ({text})"


def availability() -> Availability:
    import torch

    versions = {"torch": torch.__version__}
    try:
        facts = torch_npu_facts()
    except Exception as exc:  # not only ImportError: see the module docstring
        return Availability(False, explain_import_failure(exc, torch.version.cuda), versions)
    versions["torch_npu"] = facts["version"]
    if not facts["available"]:
        why = "no NPU is visible (torch.npu.is_available() is False)"
        return Availability(False, why, versions)
    if facts["missing"]:
        return Availability(
            False,
            f"torch_npu {facts['version']} lacks {', '.join(facts['missing'])} (ACL "
            "graphs need torch_npu from the 7.0.0 branches and CANN >= 8.1)",
            versions,
        )
    torch_npu = importlib.import_module("torch_npu")  # imported by torch_npu_facts already
    lacks = missing_apis(torch_npu)
    if lacks:
        return Availability(
            False,
            f"torch_npu {facts['version']} lacks {', '.join(lacks)} (as_tensor over aclrt "
            "virtual memory needs torch_npu from the 7.3.0 branches on)",
            versions,
        )
    fused = versions["fused decode"] = fused_decode_support(torch_npu)
    era = versions["pool era"] = facts["era"]
    shared = "on" if era == "owner" else "off: falls back to shared-pool"
    return Availability(
        True,
        f"{facts['devices']}; {era}-era MemPool (shared-physical {shared}); FusedDecodeRunner "
        f"{fused}; verified against the simulated runtime only, run "
        "adapters/ascend/scripts/hardware_check.py",
        versions,
    )

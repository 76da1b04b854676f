"""Availability of the Ascend backend: torch_npu importable, an NPU visible, the APIs present.

Importing torch_npu can fail in many ways besides "not installed", and some of them are not
ImportErrors: missing CANN libraries (`libhccl.so: cannot open shared object file`), torch's
backend autoload failing (the RuntimeError naming TORCH_DEVICE_BACKEND_AUTOLOAD), a CUDA
build of torch ("Two accelerators cannot be used at the same time"). The probe catches any
exception and names the cause and the fix.
"""

from __future__ import annotations

import re

from xgraph.interfaces import Availability

from .runtime import torch_npu_facts

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
    era = versions["pool era"] = facts["era"]
    shared = "on" if era == "owner" else "off: falls back to shared-pool"
    return Availability(
        True,
        f"{facts['devices']}; {era}-era MemPool (shared-physical {shared}); verified against "
        "the simulated runtime only, run adapters/ascend/scripts/hardware_check.py",
        versions,
    )

"""ACL error codes as xgraph errors: each carries the runtime's error name and what to do.

torch_npu reports a failed runtime call as a RuntimeError whose text holds the ACL code; the
simulator raises AclRuntimeError with the code as a field. `acl_code` reads either.
VirtualMemoryError (aclrt VMM calls) and CaptureError (107xxx capture errors, 207008 stream
resources, 507903 invalidated captures) carry the name from rt_error_codes.h and advice.
"""

from __future__ import annotations

import re
import threading

from xgraph.errors import CaptureError, VirtualMemoryError, XGraphError

# rt_error_codes.h / acl_base_rt.h (hicann/runtime)
ACL_ERROR_NAMES: dict[int, str] = {
    0: "ACL_SUCCESS",
    100000: "ACL_ERROR_INVALID_PARAM",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107002: "ACL_ERROR_RT_CONTEXT_NULL",
    107008: "ACL_ERROR_RT_ADDR_UNALIGNED",
    107017: "ACL_ERROR_RT_INVALID_HANDLE",
    107019: "ACL_ERROR_RT_WAIT_TIMEOUT",
    107024: "ACL_ERROR_RT_CAPTURE_DEPENDENCY",
    107025: "ACL_ERROR_RT_STREAM_UNJOINED",
    107026: "ACL_ERROR_RT_MODEL_CAPTURED",
    107027: "ACL_ERROR_RT_STREAM_CAPTURED",
    107028: "ACL_ERROR_RT_EVENT_CAPTURED",
    107029: "ACL_ERROR_RT_STREAM_NOT_CAPTURED",
    107030: "ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT",
    107031: "ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT",
    107032: "ACL_ERROR_STREAM_CAPTURE_CONFLICT",
    107033: "ACL_ERROR_STREAM_TASK_GROUP_STATUS",
    107034: "ACL_ERROR_STREAM_TASK_GROUP_INTR",
    107036: "ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED",
    107037: "ACL_ERROR_RT_MODEL_RUNNING",
    107038: "ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD",
    107041: "ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207002: "ACL_ERROR_RT_MEMORY_FREE",
    207005: "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL",
    207008: "ACL_ERROR_RT_NO_STREAM_RESOURCE",
    207012: "ACL_ERROR_RT_OVER_LIMIT",
    207018: "ACL_ERROR_RT_DEVICE_OOM",
    207019: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT_UPDATE_OP",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
    507903: "ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED",
}
_CODES = {name: code for code, name in ACL_ERROR_NAMES.items()}

OOM_CODES = {207001, 207018}
CAPTURE_CODES = {c for c in ACL_ERROR_NAMES if 107024 <= c <= 107041} | {207008, 507903}

_ADVICE: dict[int, str] = {
    100000: "An argument broke a documented rule of the call (see docs/ascend.md, 'rules').",
    107000: "An argument broke a documented rule of the call (see docs/ascend.md, 'rules').",
    107008: "Addresses and sizes must be multiples of the 2 MiB VMM granularity.",
    107017: "The handle or address is not live (freed, never created, or already unmapped).",
    207000: "This driver lacks the feature (aclrt VMM needs the halMem* driver API); upgrade "
    "the Ascend HDK, or use memory='shared-pool'.",
    207001: "The NPU is out of memory: free memory (torch.npu.empty_cache(), a smaller KV "
    "cache) or capture fewer sizes.",
    207018: "The NPU is out of memory: free memory or capture fewer sizes.",
    207008: "The NPU ran out of stream resources for captured graphs: capture fewer sizes "
    "(fewer buckets), prefer full graphs to piecewise ones (each piece holds streams), or "
    "upgrade the HDK (>= 25.5.1 if the log says 'alloc sq cq fail').",
    207019: "The ops re-launched in a graph task update must match the captured task group in "
    "number and type; graph task update needs HDK >= 25.0.RC1 on Atlas A2/A3.",
    107030: "A synchronizing or otherwise forbidden call ran while a stream was capturing "
    "(torch.npu.synchronize, .item(), aclrtMemcpy, ...); keep it out of the captured forward.",
    107031: "Work was issued on the default stream during capture; run it on the capture "
    "stream (the forward must not switch streams).",
    107025: "A stream forked from the capture stream was not joined back before capture_end; "
    "make the capture stream wait on every side stream.",
    107038: "capture_end ran on another thread than capture_begin (thread_local mode).",
    507903: "An earlier error (often a synchronizing call) invalidated the capture; find it in "
    "the log, keep it out of the captured forward.",
}
_CAPTURE_DEFAULT = (
    "The NPU runtime refused the capture. Run the forward eagerly to find the op that cannot "
    "be captured (aclop operators, synchronizing calls, host copies), or leave it out."
)


class AclRuntimeError(RuntimeError):
    """A failed ACL call, as the simulated runtime raises it (torch_npu raises RuntimeError)."""

    def __init__(self, code: int, call: str, detail: str = "") -> None:
        self.code = code
        self.call = call
        super().__init__(
            f"{call} failed: {error_name(code)} ({code}){': ' if detail else ''}{detail}"
        )


def error_name(code: int) -> str:
    return ACL_ERROR_NAMES.get(int(code), f"aclError {int(code)}")


def advice(code: int) -> str:
    if code in _ADVICE:
        return _ADVICE[code]
    return _CAPTURE_DEFAULT if code in CAPTURE_CODES else ""


_NUMBER = re.compile(r"(?<!\d)([1-5]\d{5})(?!\d)")


def acl_code(exc: BaseException) -> int | None:
    """The ACL error code an exception carries (field, name or number in its text), if any."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    text = str(exc)
    if "stream resources are insufficient" in text or "alloc sq cq fail" in text:
        return 207008
    for name, c in _CODES.items():
        if c and name in text:
            return c
    for m in _NUMBER.finditer(text):
        if int(m.group(1)) in ACL_ERROR_NAMES:
            return int(m.group(1))
    return None


def vmm_error(call: str, code: int, recent: str = "", extra: str = "") -> VirtualMemoryError:
    """VirtualMemoryError for a failed aclrt VMM call; remembered for this thread (see below)."""
    hint = " ".join(p for p in (f"({recent})" if recent else "", extra, advice(code)) if p)
    err = VirtualMemoryError(call, f"{error_name(code)} ({code})", hint)
    err.code = code  # type: ignore[attr-defined]
    _last.failure = err
    return err


def capture_error(exc: BaseException, what: str) -> CaptureError:
    """CaptureError for a runtime failure during (or at the end of) a capture."""
    code = acl_code(exc)
    if code is None:
        return CaptureError(f"{what} failed: {exc}. {_CAPTURE_DEFAULT}")
    err = CaptureError(f"{what} failed: {error_name(code)} ({code}): {exc}. {advice(code)}")
    err.code = code  # type: ignore[attr-defined]
    return err


# A VMM failure inside torch_npu's allocator callback cannot raise through C: the pool logs
# it and the allocator reports out of memory. The capture's error translation takes it from
# here, so the error the caller sees names the ACL call that failed.
_last = threading.local()


def take_vmm_failure() -> VirtualMemoryError | None:
    err = getattr(_last, "failure", None)
    _last.failure = None
    return err


def translate_op_error(exc: RuntimeError, op: object) -> XGraphError | None:
    """An xgraph error for a runtime error raised by an op during capture, or None."""
    code = acl_code(exc)
    if code in OOM_CODES or "out of memory" in str(exc).lower():
        vmm = take_vmm_failure()
        if vmm is None:
            return None  # plain device OOM: torch_npu's own message says it best
        err = VirtualMemoryError(
            vmm.call,
            vmm.error,
            f"while {op} allocated graph memory during capture; the shared-physical pool could "
            f"not grow. {advice(getattr(vmm, 'code', 207001))}",
        )
        err.code = getattr(vmm, "code", None)  # type: ignore[attr-defined]
        return err
    if code in CAPTURE_CODES:
        return capture_error(exc, f"capturing {op}")
    return None


def runtime_error(exc: BaseException, what: str) -> XGraphError:
    """An XGraphError for a failed runtime call outside capture (replay, synchronize)."""
    code = acl_code(exc)
    if code is None:
        return XGraphError(f"{what} failed: {exc}")
    return XGraphError(f"{what} failed: {error_name(code)} ({code}): {exc}. {advice(code)}")

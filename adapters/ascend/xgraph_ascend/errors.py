"""ACL error codes as xgraph errors: each carries the runtime's error name and what to do.

torch_npu reports a failed runtime call as a RuntimeError whose text holds the ACL code; the
simulator raises AclRuntimeError with the code as a field. `acl_code` reads either.
VirtualMemoryError (aclrt VMM calls) and CaptureError (107xxx capture errors, 207008/207010
stream and model resources, 507903 invalidated captures, 107000 from an op during capture: a
pageable host copy) carry the name from rt_error_codes.h and advice.
"""

from __future__ import annotations

import re
import threading

from xgraph.adapter import CaptureError, VirtualMemoryError, XGraphError

# rt_error_codes.h / acl_base_rt.h (hicann/runtime)
ACL_ERROR_NAMES: dict[int, str] = {
    0: "ACL_SUCCESS",
    100000: "ACL_ERROR_INVALID_PARAM",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107001: "ACL_ERROR_RT_INVALID_DEVICEID",
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
    107040: "ACL_ERROR_RT_MODEL_UPDATE_FAILED",
    107041: "ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC",
    107045: "ACL_ERROR_RT_SUB_ACLGRAPH_IS_CAPTURING",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    207002: "ACL_ERROR_RT_MEMORY_FREE",
    207005: "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL",
    207008: "ACL_ERROR_RT_NO_STREAM_RESOURCE",
    207010: "ACL_ERROR_RT_NO_MODEL_RESOURCE",
    207012: "ACL_ERROR_RT_OVER_LIMIT",
    207018: "ACL_ERROR_RT_DEVICE_OOM",
    207019: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT_UPDATE_OP",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507046: "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
    507047: "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
    507903: "ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED",
}
# aclnn_base.h: what an aclnn op (npu_fused_infer_attention_score, ...) returns for bad input
ACLNN_ERROR_NAMES: dict[int, str] = {
    161001: "ACLNN_ERR_PARAM_NULLPTR",
    161002: "ACLNN_ERR_PARAM_INVALID",
}
ACL_ERROR_NAMES.update(ACLNN_ERROR_NAMES)

# longest name first: ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000) is a prefix of
# ACL_ERROR_RT_FEATURE_NOT_SUPPORT_UPDATE_OP (207019), and the text may name either
_CODES = {
    name: code
    for code, name in sorted(ACL_ERROR_NAMES.items(), key=lambda item: -len(item[1]))
    if code
}

OOM_CODES = {207001, 207018}
# what a capture (or the end of one) can fail with: the 107xxx capture and task-group codes,
# the stream and model resources every captured graph holds, an invalidated capture
CAPTURE_CODES = {c for c in ACL_ERROR_NAMES if 107024 <= c <= 107045} | {207008, 207010, 507903}

SYNC_TIMEOUT_CODES = {507046, 507047}  # a stream or event synchronize that timed out

_RESOURCES = (
    "capture fewer sizes (fewer buckets), prefer full graphs to piecewise ones (each piece "
    "holds streams), or upgrade the HDK (>= 25.5.1 if the log says 'alloc sq cq fail')."
)
_ADVICE: dict[int, str] = {
    100000: "An argument broke a documented rule of the call (see docs/ascend.md, 'rules').",
    107000: "An argument broke a documented rule of the call (see docs/ascend.md, 'rules').",
    107001: "The device id names no NPU of this process; use one below the device count.",
    107008: "Addresses and sizes must be multiples of the 2 MiB VMM granularity.",
    107017: "The handle or address is not live (freed, never created, or already unmapped).",
    207000: "This driver lacks the feature (aclrt VMM needs the halMem* driver API); upgrade "
    "the Ascend HDK, or use memory='shared-pool'.",
    207001: "The NPU is out of memory: free memory (torch.npu.empty_cache(), a smaller KV "
    "cache) or capture fewer sizes.",
    207018: "The NPU is out of memory: free memory or capture fewer sizes.",
    207008: "The NPU ran out of stream resources for captured graphs: " + _RESOURCES,
    207010: "The NPU ran out of model resources for captured graphs: " + _RESOURCES,
    207019: "This driver cannot update this op: upgrade the HDK/driver (graph task update "
    "needs HDK >= 25.0.RC1 on Atlas A2/A3; the Atlas training series and Atlas 200I/500 A2 "
    "have none). Until then, decode with the core's PagedDecodeRunner.",
    507000: "The runtime failed internally. After a graph task update this is how a mismatch "
    "is reported: the ops re-launched between graph_task_update_begin and _end must match the "
    "captured task group in count and kernel type (aclGetRecentErrMsg: 'task group update "
    "error' or 'kernel type error').",
    107027: "A stream is capturing: a synchronize (torch.npu.synchronize, a stream or event "
    "synchronize or query, .item(), .cpu()) fails while any stream of the device captures, in "
    "every capture mode and from every thread, and a capture or task update cannot begin on a "
    "capturing stream. Keep synchronizing calls out of the captured forward and out of other "
    "threads while a capture runs.",
    107030: "A synchronous copy or memset (aclrtMemcpy, aclrtMemset, aclrtMemcpy2d) ran while "
    "a stream was capturing in a mode that forbids it; keep it out of the captured forward "
    "(copy asynchronously from pinned memory instead).",
    107031: "Work was issued on the default stream during capture; run it on the capture "
    "stream (the forward must not switch streams).",
    107025: "A stream forked from the capture stream was not joined back before capture_end; "
    "make the capture stream wait on every side stream.",
    107038: "capture_end ran on another thread than capture_begin (thread_local mode).",
    107040: "The runtime could not update the captured model; capture the graph again.",
    107045: "A sub ACL graph of this capture is still capturing; end it before this one.",
    507046: "A stream synchronize timed out: a captured ExternalEvent wait whose graph task "
    "update never ran, or a kernel that does not finish.",
    507047: "An event synchronize timed out: a captured ExternalEvent wait whose graph task "
    "update never ran, or a kernel that does not finish.",
    161002: "An aclnn op refused its arguments (dtype, layout, contiguity or a tiling limit "
    "such as the paged block size); the op's message names the argument. FusedDecodeRunner's "
    "limits are in docs/ascend.md.",
    507903: "An earlier error (often a synchronizing call) invalidated the capture; find it in "
    "the log, keep it out of the captured forward.",
}
# what a code means when an op raised it while its stream was capturing
_CAPTURE_ADVICE: dict[int, str] = {
    107000: "During capture this is how the runtime refuses a copy between pageable host "
    "memory and the device ('The pageable memory copy task does not support graph capture', "
    "in every capture mode): copy from pinned memory (tensor.pin_memory()) or before the "
    "capture.",
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


def advice(code: int, capturing: bool = False) -> str:
    """What to do about `code`; `capturing`: the code came from an op of a capture."""
    if capturing and code in _CAPTURE_ADVICE:
        return _CAPTURE_ADVICE[code]
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
    for name, c in _CODES.items():  # longest first
        if name in text:
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
    hint = advice(code, capturing=True)
    err = CaptureError(f"{what} failed: {error_name(code)} ({code}): {exc}. {hint}")
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
    if code in CAPTURE_CODES or code in _CAPTURE_ADVICE:
        return capture_error(exc, f"capturing {op}")
    return None


def runtime_error(exc: BaseException, what: str) -> XGraphError:
    """An XGraphError for a failed runtime call outside capture (replay, synchronize)."""
    code = acl_code(exc)
    if code is None:
        return XGraphError(f"{what} failed: {exc}")
    return XGraphError(f"{what} failed: {error_name(code)} ({code}): {exc}. {advice(code)}")

"""The ACL error table against hicann/runtime: names, what each code means, and which
errors of an op during capture become a CaptureError."""

from __future__ import annotations

import pytest
import torch
from xgraph_ascend import errors
from xgraph_ascend.errors import AclRuntimeError, acl_code, advice, error_name

import xgraph
from xgraph import CaptureError


@pytest.mark.parametrize(
    "code, name",
    [
        (107040, "ACL_ERROR_RT_MODEL_UPDATE_FAILED"),
        (107045, "ACL_ERROR_RT_SUB_ACLGRAPH_IS_CAPTURING"),
        (207010, "ACL_ERROR_RT_NO_MODEL_RESOURCE"),
        (507046, "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT"),
        (507047, "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT"),
        (161002, "ACLNN_ERR_PARAM_INVALID"),
    ],
)
def test_the_codes_the_table_lacked(code: int, name: str) -> None:
    assert error_name(code) == name
    assert acl_code(RuntimeError(f"call failed: {name}")) == code
    assert advice(code)


def test_the_longest_name_is_matched_first() -> None:
    """ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000) is a prefix of ..._UPDATE_OP (207019)."""
    text = "graph_task_update_end failed: ACL_ERROR_RT_FEATURE_NOT_SUPPORT_UPDATE_OP"
    assert acl_code(RuntimeError(text)) == 207019
    assert acl_code(RuntimeError("failed: ACL_ERROR_RT_FEATURE_NOT_SUPPORT.")) == 207000
    names = list(errors._CODES)
    for i, a in enumerate(names):  # no name is found inside one matched before it
        assert not any(a in b and a != b for b in names[i + 1 :]), a


def test_what_each_code_means() -> None:
    assert "synchroniz" in advice(107027) and "every thread" in advice(107027)
    assert "aclrtMemcpy" in advice(107030) and "synchronize" not in advice(107030)
    assert advice(207019).startswith("This driver cannot update this op: upgrade the HDK")
    assert "count and kernel type" in advice(507000)
    assert "capture fewer sizes" in advice(207010)
    assert {107027, 107040, 107045, 207008, 207010, 507903} <= errors.CAPTURE_CODES


def test_a_pageable_copy_during_capture_is_a_capture_error() -> None:
    """107000 from an op while its stream captures: the runtime's refusal of a pageable host
    copy, translated with its own advice (outside capture 107000 keeps the generic one)."""
    exc = RuntimeError(
        "Asynchronous copy task: The pageable memory copy task does not support graph "
        "capture, error code is 107000"
    )
    err = errors.translate_op_error(exc, "aten::copy_")
    assert isinstance(err, CaptureError)
    assert "ACL_ERROR_RT_PARAM_INVALID (107000)" in str(err) and "pin_memory()" in str(err)
    assert "pin_memory" not in advice(107000)
    assert errors.translate_op_error(RuntimeError("shape mismatch"), "aten::add") is None


_lib = torch.library.Library("xgraph_ascend_test", "DEF")
_lib.define("pageable_h2d(Tensor x) -> Tensor")


def _pageable_h2d(x: torch.Tensor) -> torch.Tensor:
    raise AclRuntimeError(
        107000, "aclrtMemcpyAsync", "The pageable memory copy task does not support graph capture"
    )


_lib.impl("pageable_h2d", _pageable_h2d, "CompositeExplicitAutograd")


def test_an_op_that_fails_with_107000_in_a_capture_raises_capture_error(sim) -> None:  # type: ignore[no-untyped-def]
    graph, pool = sim.new_graph(), sim.new_pool()
    x = torch.ones(4)
    with pytest.raises(CaptureError, match="pin_memory") as info:
        with xgraph.graph(graph, pool):
            torch.ops.xgraph_ascend_test.pageable_h2d(x)
    assert info.value.code == 107000  # type: ignore[attr-defined]
    pool.close()
    assert sim.runtime.books() == dict.fromkeys(sim.runtime.books(), 0)

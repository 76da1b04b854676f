"""xgraph's custom ops, defined on the dispatcher directly (xgraph.opdef): what they answer
with no gradient wanted, the error where one is, and their schemas (the cache writes of
`xgraph::attention` declared, so compiled code keeps them in place)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import xgraph.attention  # noqa: F401  (defines xgraph::attention)
from xgraph import linear as core_linear
from xgraph.errors import XGraphError
from xgraph.fusion import Fusion, reference


def _xw() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_linear_ops_answer_without_a_gradient(mode) -> None:  # type: ignore[no-untyped-def]
    x, w = _xw()
    norm = torch.rand(8) + 0.5
    r = torch.randn(3, 5)
    with mode():
        assert torch.equal(torch.ops.xgraph.linear.default(x, w), F.linear(x, w))
        got = torch.ops.xgraph.fused_linear.default(
            x, w, norm, 1e-6, False, r, None, None, 0.0, None, 0, 0
        )
        want = reference(x, w, Fusion(norm=norm, residual=r), F.linear)
    assert torch.equal(got, want)


def test_an_op_where_a_gradient_is_wanted_is_an_error() -> None:
    x, w = _xw()
    w.requires_grad_(True)
    with pytest.raises(XGraphError, match=r"xgraph::linear has no backward.*no_grad"):
        torch.ops.xgraph.linear.default(x, w)
    with pytest.raises(XGraphError, match=r"xgraph::fused_linear has no backward"):
        torch.ops.xgraph.fused_linear.default(
            x, w, None, 1e-6, False, None, None, None, 0.0, None, 0, 0
        )
    q = torch.randn(2, 2, 4, requires_grad=True)
    cache = torch.zeros(3, 4, 1, 4)
    with pytest.raises(XGraphError, match=r"xgraph::attention has no backward"):
        torch.ops.xgraph.attention.default(q, q[:, :1], q[:, :1], cache, cache.clone(), 0.5)
    # the Python call site picks F.linear for such inputs instead of the op
    assert core_linear.linear(x, w).requires_grad


def test_the_schemas_declare_the_cache_writes_and_nothing_else() -> None:
    attn = torch.ops.xgraph.attention.default._schema
    written = [a.name for a in attn.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"]
    for op in (torch.ops.xgraph.linear.default, torch.ops.xgraph.fused_linear.default):
        assert not any(a.alias_info is not None for a in op._schema.arguments)

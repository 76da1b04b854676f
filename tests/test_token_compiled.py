"""TokenCompiled: one compile for every token count, its fallbacks, its Inductor settings."""

from __future__ import annotations

import warnings

import pytest
import torch

from xgraph.compiled import DYNAMIC_INDUCTOR_CONFIG, TokenCompiled
from xgraph.errors import XGraphWarning


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 2 + 1


def _branching(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= 4:  # Python that reads the token count: a guard on the symbol
        return x * 2
    return x * 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_one_compile_serves_every_count_from_two_and_one_more_serves_one():
    w = torch.randn(8, 8)
    tc = TokenCompiled(_scaled, max_tokens=32, backend="eager")
    for n in (1, 2, 3, 7, 16, 32):
        x = torch.randn(n, 8)
        assert torch.equal(tc(x, w), _scaled(x, w))
    assert tc.compiles == 2
    assert tc.stats()["sizes"] == [1, 2, 3, 7, 16, 32]


def _pair(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.where(y > 0, x, -x)


def test_two_instances_over_one_tensor_keep_to_their_own_bounds():
    """A tensor two compiled functions take (a decoder's input ids, a multi-step loop's)
    carries only the bounds of the call it is in: the one of narrower bounds neither falls
    back to per-size compiles nor fails a static compile over the other's marks."""
    w = torch.randn(8, 8)
    wide = TokenCompiled(_scaled, max_tokens=32, backend="eager", name="wide")
    narrow = TokenCompiled(_pair, max_tokens=4, backend="eager", name="narrow")
    x = torch.randn(4, 8)  # the shared one
    with warnings.catch_warnings():
        warnings.simplefilter("error", XGraphWarning)
        for _ in range(2):
            assert torch.equal(wide(x, w), _scaled(x, w))
            y = torch.randn(4, 8)  # the narrow function's own
            assert torch.equal(narrow(x, y), _pair(x, y))
    assert (wide.compiles, narrow.compiles) == (1, 1)
    assert wide.stats()["per_size"] is None and narrow.stats()["per_size"] is None


def test_per_size_compiles_once_per_count_and_above_the_largest_runs_uncompiled():
    w = torch.randn(8, 8)
    tc = TokenCompiled(_scaled, max_tokens=8, backend="eager", dynamic=False)
    for n in (2, 3, 5, 40):
        x = torch.randn(n, 8)
        assert torch.equal(tc(x, w), _scaled(x, w))
    assert tc.compiles == 3
    assert 40 not in tc.stats()["sizes"]


def test_a_forward_branching_on_the_count_is_compiled_per_size_with_a_warning():
    tc = TokenCompiled(_branching, max_tokens=16, backend="eager")
    x = torch.ones(3, 2)
    with pytest.warns(XGraphWarning, match="compiled once per token count"):
        assert torch.equal(tc(x), x * 2)
    for n in (2, 9, 16):
        y = torch.ones(n, 2)
        assert torch.equal(tc(y), _branching(y))
    stats = tc.stats()
    assert stats["dynamic"] is False
    assert "satisfy the generated guard" in stats["per_size"]
    assert stats["fallback"] is None
    assert stats["sizes"] == [2, 3, 9, 16]


def test_the_compiles_run_under_the_inductor_settings_given():
    import torch._inductor.config as inductor

    seen: list[object] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append((inductor.realize_opcount_threshold, inductor.triton.persistent_reductions))
        return gm.forward

    w = torch.randn(4, 4)
    before = (inductor.realize_opcount_threshold, inductor.triton.persistent_reductions)
    tc = TokenCompiled(_scaled, 8, backend=backend, inductor_config=DYNAMIC_INDUCTOR_CONFIG)
    tc(torch.randn(3, 4), w)
    plain = TokenCompiled(_scaled, 8, backend=backend)
    plain(torch.randn(3, 4), w)
    given = (
        DYNAMIC_INDUCTOR_CONFIG["realize_opcount_threshold"],
        DYNAMIC_INDUCTOR_CONFIG["triton.persistent_reductions"],
    )
    assert given != before
    assert seen == [given, before]
    assert (inductor.realize_opcount_threshold, inductor.triton.persistent_reductions) == before


def _hints_seen(seen: list[dict[str, int]]):
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        env = torch._guards.TracingContext.try_get().fake_mode.shape_env
        seen.append({str(k): int(v) for k, v in env.backed_var_to_val.items()})
        return gm.forward

    return backend


@pytest.mark.parametrize(("hint", "expected"), [(8, 8), (1, 2), (500, 64), (None, 48)])
def test_the_dynamic_graph_is_chosen_for_the_hinted_count_not_the_first_traced(hint, expected):
    seen: list[dict[str, int]] = []
    w = torch.randn(4, 4)
    tc = TokenCompiled(_scaled, 64, backend=_hints_seen(seen), hint=hint)
    for n in (48, 5, 64):
        x = torch.randn(n, 4)
        assert torch.equal(tc(x, w), _scaled(x, w))
    assert tc.compiles == 1
    assert [list(s.values()) for s in seen] == [[expected]]
    assert tc.stats()["hint"] == (None if hint is None else expected)


def test_per_size_compiles_take_no_hint():
    seen: list[dict[str, int]] = []
    tc = TokenCompiled(_scaled, 16, backend=_hints_seen(seen), dynamic=False, hint=8)
    tc(torch.randn(12, 4), torch.randn(4, 4))
    assert seen == [{}]
    assert tc.stats()["hint"] is None

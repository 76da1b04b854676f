"""xgraph.row_argmax: torch's argmax bit for bit, in two stages, over rows with ties, NaN and
infinities where the pieces split them (eager, and compiled with aot_eager and Inductor)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xgraph.row_argmax import row_argmax


def _row(seed: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Few distinct values (ties across pieces are common), a NaN, +inf or -inf planted at
    random columns, the tail past the last whole piece included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, cols), generator=g).to(dtype)
    for value in (float("nan"), float("inf"), float("-inf"), 9.0):
        hit = torch.rand(rows, cols, generator=g) < 0.3 / cols
        x[hit] = value
    return x


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 5),
    cols=st.sampled_from([7, 4 * 16, 4 * 16 + 3, 9 * 16 - 1, 33 * 16, 33 * 16 + 15]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_row_argmax_is_torch_argmax(seed, rows, cols, dtype):
    x = _row(seed, rows, cols, dtype)
    assert torch.equal(row_argmax(x, chunk=16), x.argmax(-1))


def test_row_argmax_at_a_vocabulary_of_qwen3():
    x = torch.randn(3, 151_936).bfloat16()
    x[0, 5], x[0, 151_900] = 50, 50  # a tie between the first piece and the tail
    x[1, -1] = 60  # the maximum in the tail alone
    x[2, 2048], x[2, 1024] = float("nan"), float("nan")  # the first NaN wins
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert row_argmax(x).tolist() == [5, 151_935, 1024]


def test_row_argmax_of_other_shapes_is_argmax():
    x = torch.randn(2, 3, 5000)
    assert torch.equal(row_argmax(x), x.argmax(-1))  # not 2-D: one stage


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_row_argmax_compiled_is_torch_argmax(backend):
    fn = torch.compile(row_argmax, backend=backend, dynamic=False, fullgraph=True)
    for seed in range(6):
        x = _row(seed, 2, 64 * 16 + 5, torch.float32)
        x[0, 16 * 3] = x[0, 16 * 40] = 99.0  # a tie two pieces apart
        assert torch.equal(fn(x, 16), x.argmax(-1)), seed

"""Intervals (the VirtualMemory books) answer as a linear scan of every range would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xgraph.intervals import Intervals

GRAN = 16


def _scan_overlap(ranges: dict[int, int], start: int, end: int) -> bool:
    return any(s < end and start < s + n for s, n in ranges.items())


def _scan_holds(ranges: dict[int, int], start: int, end: int) -> bool:
    return any(s <= start and end <= s + n for s, n in ranges.items())


ops = st.lists(
    st.tuples(st.sampled_from(["add", "pop", "ask"]), st.integers(0, 63), st.integers(1, 6)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_answers_equal_a_linear_scan(sequence: list[tuple[str, int, int]]) -> None:
    books: Intervals[str] = Intervals()
    model: dict[int, int] = {}
    for op, slot, length in sequence:
        start, end = slot * GRAN, (slot + length) * GRAN
        overlap = _scan_overlap(model, start, end)
        found = books.overlapping(start, end)
        assert (found is not None) == overlap
        if found is not None:
            assert found < end and start < found + model[found]
        assert books.holds(start, end) == _scan_holds(model, start, end)
        assert books.starts_within(start, end) == sorted(s for s in model if start <= s < end)
        if op == "add" and not overlap:
            books.add(start, end - start, f"r{slot}")
            model[start] = end - start
        elif op == "pop" and start in model:
            assert books.pop(start) == (model.pop(start), f"r{slot}")
        assert len(books) == len(model)
        assert [(s, n) for s, n, _ in books.items()] == sorted(model.items())


def test_a_start_taken_twice_is_refused() -> None:
    books: Intervals[None] = Intervals()
    books.add(0, GRAN, None)
    with pytest.raises(KeyError, match="already starts"):
        books.add(0, GRAN, None)

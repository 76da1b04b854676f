"""Fault injection for simulated runtimes: make any runtime call fail with a chosen code."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass
class _Fault:
    code: int
    after: int  # calls to let through first
    times: int  # failures left


class Faults:
    """Armed failures by call name, and a count of every call made (tests read both).

    faults.inject("aclrtMallocPhysical", 207001, after=3)  # the 4th call fails once
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, list[_Fault]] = {}
        self.calls: Counter[str] = Counter()
        self.fired: list[tuple[str, int]] = []

    def inject(self, call: str, code: int, *, after: int = 0, times: int = 1) -> None:
        """Make `call` fail with `code` `times` times, after `after` successful calls."""
        if code == 0 or times < 1 or after < 0:
            raise ValueError("inject a non-zero code, times >= 1 and after >= 0")
        with self._lock:
            self._armed.setdefault(call, []).append(_Fault(int(code), after, times))

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def check(self, call: str) -> int:
        """Count the call; return the code it must fail with, or 0."""
        with self._lock:
            self.calls[call] += 1
            for f in self._armed.get(call, []):
                if f.after:
                    f.after -= 1
                    continue
                f.times -= 1
                if f.times == 0:
                    self._armed[call].remove(f)
                self.fired.append((call, f.code))
                return f.code
            return 0

    def pending(self) -> dict[str, int]:
        """Armed failures not fired yet, by call (a test whose fault never fired is wrong)."""
        with self._lock:
            return {c: sum(f.times for f in fs) for c, fs in self._armed.items() if fs}

"""A capture session: the garbage collector frozen and off while graphs are captured.

    with xgraph.capture_session.capture_session():
        ...  # captures and warm-ups; `GraphExecutor.capture` / `warm_up` open one themselves

Python's collector runs whenever allocations pass its thresholds, and a full collection walks
every object the process holds: an engine's heap (a model, a tokenizer, the compiler's
caches) takes it from milliseconds to a large part of each capture (vLLM: 35 s to 2 s for
67 graphs of Qwen3-0.6B once it froze the collector, PR #21146). A collection in the middle
of a capture is a hazard too: a finalizer it runs may free device memory or call into the
runtime while the stream is being captured. So a session collects the young generations
when it opens (the garbage the last steps left dies then, not mid-capture), freezes what
survives (an explicit `gc.collect()` inside, torch's own among them, then skips it) and
disables the collector. It does not walk the old generation: that is nearly the whole heap,
and a start-up opens a session for each of its warm-ups, plans and captures (eight for the
transformers Qwen3 through `GraphModel`), where a full collection of a transformers process
took 0.23 s each on a 2-core host; an engine that wants one calls `gc.collect()` first;
leaving it, on every path (an exception, KeyboardInterrupt), unfreezes and puts the
collector back as it was. Sessions nest (only the outermost one acts) and are process-wide,
as the collector is: other threads run without automatic collection meanwhile.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("xgraph")

YOUNG = 1  # generations collected when a session opens: 0 and 1 (see the module doc)
_lock = threading.Lock()
_depth = 0
_was_enabled = False
_was_frozen = 0


def _open() -> None:
    global _depth, _was_enabled, _was_frozen
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        _was_enabled, _was_frozen = gc.isenabled(), gc.get_freeze_count()
        gc.disable()  # first: no automatic collection between the collect and the freeze
        t0 = time.perf_counter()
        gc.collect(YOUNG)
        gc.freeze()
        if logger.isEnabledFor(logging.DEBUG):  # the count walks every frozen object
            logger.debug(
                "capture session: %d objects frozen (%.3f s)",
                gc.get_freeze_count(),
                time.perf_counter() - t0,
            )


def _close() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        if not _was_frozen:  # objects a caller froze before stay frozen: its own choice
            gc.unfreeze()
        if _was_enabled:
            gc.enable()


@contextmanager
def capture_session() -> Iterator[None]:
    """The collector collected once, frozen and off inside; restored on every way out."""
    _open()
    try:
        yield
    finally:
        _close()


def active() -> bool:
    """Whether a capture session is open (in any thread)."""
    return _depth > 0

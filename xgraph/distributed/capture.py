"""Lockstep capture: one key captured on every rank at once, its collectives checked.

The executor captures a key in two passes, warm-up (eager) and the recording; both issue
the forward's collectives (on a GPU the warm-up runs them, on the CPU backend both do). So
each rank records its collectives in order (`CollectiveRecorder`) and, before letting one
through, announces it on the side group: (pass, index, hash). If any rank's differs, or one
rank's forward ends while another's issues more, every rank learns it in that same exchange,
swaps its version in words (a second exchange on the error path) and raises
CollectiveMismatchError naming the collective and each rank's version; nothing mismatched
is ever issued, so nothing hangs (gloo even aborts the process on one). After the
recording each rank sends the hash of its manifest and whether its capture succeeded.

A rank whose warm-up or capture fails sends that failure as its next message: the others
learn it at their next exchange, roll back and raise PeerCaptureError, so every rank
handles the key the same way (on_capture_error). Exceptions every rank knows of are marked
as agreed, so the executor does not mistake them for a rank gone astray.

An eager step (above the buckets, `mode="eager"`, a key whose capture failed) runs the
forward once, under the same check (`eager_scope`): its collectives are announced and its
end agreed, so ranks whose forwards differ (built with other dtypes, say) raise
CollectiveMismatchError on every rank before the differing collective is issued, and a
rank whose forward fails makes the others raise PeerStepError at the same point.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from ..errors import XGraphError
from .channel import ANNOUNCE, RESULT, Channel
from .errors import CollectiveMismatchError, DistributedError, PeerCaptureError, PeerStepError
from .manifest import Collective, CollectiveRecorder, first_difference, manifest_digest

PASSES = {"warm-up": 1, "capture": 2, "eager": 3}


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark an exception as known to every rank (raised on all of them alike)."""
    exc._xgraph_agreed = True  # type: ignore[attr-defined]
    return exc


def is_agreed(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from, is known to every rank."""
    seen = 0
    while exc is not None and seen < 20:
        if getattr(exc, "_xgraph_agreed", False):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class CaptureCheck:
    """One key's warm-up and capture across ranks (see the module docstring)."""

    def __init__(
        self,
        channel: Channel | None,
        labels: Any,
        key: tuple,
        record: bool = True,
        eager: int | None = None,
    ) -> None:
        """`key`: the graph key (an eager step's: its key, or ("eager",)); `eager`: the
        tokens of an eager step, None for a capture."""
        self.channel, self.labels, self.key, self.record = channel, labels, key, record
        self.eager = eager is not None
        self.what = f"the eager step of {eager} tokens" if self.eager else f"the capture of {key}"
        self.manifests: dict[str, list[Collective]] = {}
        self.phase = "warm-up"
        self.settled = False  # every rank knows how this capture ended
        self.failed_everywhere = False  # ... and that it failed: errors from it are agreed
        self.fatal: BaseException | None = None  # the ranks cannot go on with this capture

    def recorder(self, phase: str) -> AbstractContextManager[Any]:
        """The pass's recorder; nothing for a compiled forward (under a dispatch mode Dynamo
        would run it eagerly), whose manifest stays empty."""
        self.phase = phase
        self.manifests[phase] = []
        if not self.record:
            return contextlib.nullcontext()
        rec = CollectiveRecorder(self.labels, self.announce if self.channel else None)
        self.manifests[phase] = rec.manifest
        return rec

    # -- the exchanges -----------------------------------------------------------------------

    def announce(self, c: Collective, index: int) -> None:
        """Before a collective is issued: every rank must be about to issue the same one."""
        mine = [ANNOUNCE, PASSES[self.phase], index, c.digest()]
        table = self._exchange(mine, f"collective #{index} of the {self.phase} of {self.key}")
        if all(m[:4] == mine for m in table):
            return
        self._resolve(table, pending=str(c))

    def finish(self) -> None:
        """After the recording: every rank's capture succeeded with the same manifest."""
        if self.channel is None:
            self.settled = True
            return
        m = self.manifests.get(self.phase, [])
        mine = [RESULT, 1, len(m), manifest_digest(m)]
        table = self._exchange(mine, f"the end of {self.what}")
        if all(row[:4] == mine for row in table):
            self.settled = True
            return
        self._resolve(table, pending=None)

    def fail(self, exc: BaseException | None) -> None:
        """This rank failed before its last exchange: tell the others (unless they know)."""
        if exc is None or self.settled or self.channel is None or is_agreed(exc):
            return
        self.settled = True
        try:
            self._exchange([RESULT, 0, 0, 0], f"{self.what} (failed here)")
            self.channel.gather_objects(_text(exc), "a failed capture's message")
        except DistributedError:
            return  # already broken: the caller's own error is the one to report
        self.failed_everywhere = True
        mark_agreed(exc)

    def _exchange(self, mine: list[int], what: str) -> list[list[int]]:
        assert self.channel is not None
        try:
            return self.channel.exchange(mine, what)
        except DistributedError as exc:
            self.settled = True
            raise self._fatal(exc) from exc.__cause__

    # -- when the ranks differ -----------------------------------------------------------------

    def _resolve(self, table: list[list[int]], pending: str | None) -> None:
        assert self.channel is not None
        self.settled = True
        if any(m[0] not in (ANNOUNCE, RESULT) for m in table):
            raise self._fatal(self.channel.out_of_step(table, self.what))
        failed = [r for r, m in enumerate(table) if m[0] == RESULT and m[1] == 0]
        if failed:
            texts = self.channel.gather_objects(None, "a failed capture's message")
            self.failed_everywhere = True
            raise mark_agreed(self._peer_failed(failed, texts))
        history = self._history(pending)
        everyone = self.channel.gather_objects(history, "the ranks' capture manifests")
        i, versions = first_difference(everyone)
        raise self._fatal(CollectiveMismatchError(self._mismatch(i, versions)))

    def _peer_failed(self, failed: list[int], texts: list[Any]) -> XGraphError:
        assert self.channel is not None
        why = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
        head = f"rank {self.channel.rank}: {self.what} failed on rank(s) {failed} ({why})"
        if self.eager:
            return PeerStepError(
                f"{head}; this rank stopped its own at the same point, so no rank has the "
                "step's result. The ranks are still in step: fix that rank's cause and go on."
            )
        return PeerCaptureError(f"{head}; this rank rolled its own back, as every rank did.")

    def _history(self, pending: str | None) -> list[str]:
        out = [f"{p} #{i}: {c}" for p, m in self.manifests.items() for i, c in enumerate(m)]
        if pending is not None:
            out.append(f"{self.phase} #{len(self.manifests[self.phase])}: {pending}")
        return out

    def _mismatch(self, index: int, versions: list[str]) -> str:
        each = "; ".join(f"rank {r}: {v}" for r, v in enumerate(versions))
        where = "of the eager step" if self.eager else "counting warm-up and capture"
        undone = (
            "no rank has this step's result"
            if self.eager
            else "nothing was replayed; the capture is rolled back on every rank"
        )
        return (
            f"{self.key}: the ranks' forwards issue different collectives. The first that "
            f"differs (collective {index} {where}): {each}. It was found before it was issued "
            f"and {undone}. Every rank must issue the same collectives in the same order, "
            "dtype and shape (NCCL's and HCCL's rule for graphs): look for rank-dependent "
            "code in the forward, or ranks built with different dtypes."
        )

    def _fatal(self, exc: XGraphError) -> XGraphError:
        self.failed_everywhere = not isinstance(exc, DistributedError)
        self.fatal = mark_agreed(exc)
        return exc


def _text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:400] if lines else ''}"


@contextlib.contextmanager
def eager_scope(check: CaptureCheck) -> Iterator[None]:
    """An eager step's forward under the recorder; its end agreed, a failure told."""
    rec = check.recorder("eager")
    try:
        with rec:
            yield
    except Exception as exc:
        check.fail(exc)
        raise
    check.finish()


@contextlib.contextmanager
def warm_up_scope(check: CaptureCheck) -> Iterator[None]:
    """The warm-up pass under the recorder; a failure here is told to the other ranks."""
    rec = check.recorder("warm-up")
    try:
        with rec:
            yield
    except Exception as exc:
        check.fail(exc)
        raise


class CheckedRecording:
    """A Recording (FullGraph / PiecewiseGraph) whose capture is checked across ranks.

    begin/end put the recorder around the inner recording; end() then agrees on the
    result. abort() rolls the inner recording back, tells the other ranks of a local
    failure, and raises again an error that ends the capture on every rank whatever
    on_capture_error says (a collective mismatch, the ranks losing each other), after the
    recording is dropped, so the executor's rollback still runs.
    """

    def __init__(self, inner: Any, check: CaptureCheck) -> None:
        self.inner = inner
        self.check = check
        self._mode: AbstractContextManager[Any] | None = None

    def __getattr__(self, name: str) -> Any:  # context, replay, reset, describe
        return getattr(self.inner, name)

    def begin(self) -> None:
        mode = self.check.recorder("capture")
        mode.__enter__()
        self._mode = mode
        try:
            self.inner.begin()
        except BaseException:
            self._leave()
            raise

    def end(self) -> None:
        self.inner.end()
        self._leave()
        self.check.finish()

    def abort(self) -> None:
        exc = sys.exc_info()[1]  # called while the executor handles the failure
        try:
            self.inner.abort()
        finally:
            self._leave()
        if isinstance(exc, Exception):
            self.check.fail(exc)
        if self.check.fatal is not None:
            raise self.check.fatal

    def _leave(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

"""The key cache: one executor's recorded graphs by key, the keys that run eagerly, and the
persistent output buffers every graph writes.

    entry = cache.lookup(step.key)      # a hit: cache.replay(entry, step); cache.outputs(n)
    cache.run_eager(step)               # an eager step, over its own tensors
    cache.run_padded(step, reason)      # a key that runs eagerly, over the staged buffers

The capture transaction (xgraph.capture) records a miss and stores it here. Outputs are
views of the output buffers sliced to the step's real tokens, made once per size.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .attention import InlineRunner, step_context
from .buckets import Input
from .errors import ReplayError, XGraphError
from .interfaces import AttentionRunner, Backend
from .lifetime import Entry
from .metadata import AttentionMetadata
from .options import Kind, Mode
from .paging import PagedAttention
from .runners import runners_for

if TYPE_CHECKING:
    from .steps import Staged


@dataclass
class Runners:
    """The attention runners of an executor: `decode` serves full graphs and eager steps of
    one query token per sequence, `prefill` piecewise graphs and every other eager step."""

    decode: AttentionRunner | None
    prefill: AttentionRunner | None

    @classmethod
    def pick(cls, attention: PagedAttention | None, backend: Backend, mode: Mode) -> Runners:
        """The attention's own runners, else the backend's, else the reference ones; a
        decode runner that is not graph-safe is refused where decode runs as full graphs."""
        if attention is None:
            return cls(None, None)
        decode, prefill = runners_for(backend, attention)
        if mode in (Mode.AUTO, Mode.FULL) and not decode.graph_safe:
            raise XGraphError(
                f"{type(decode).__name__} is not graph-safe, so decode cannot run as a full "
                f"graph (mode={mode.value!r}). Pass a graph-safe decode_runner, or use "
                "mode='piecewise'."
            )
        return cls(decode, prefill)

    def drop(self) -> None:
        """Let go of both runners (the executor closed): each holds its last step's metadata,
        views of the buffers whose memory goes back with the last view."""
        for runner in {id(r): r for r in (self.decode, self.prefill) if r is not None}.values():
            runner.forget()
        self.decode = self.prefill = None

    def of_graph(self, kind: Kind) -> AttentionRunner | None:
        """The runner a recording of this kind plans on each step."""
        return self.decode if kind is Kind.FULL else self.prefill

    def of_eager(self, step: Staged) -> AttentionRunner | None:
        """The runner an eager step's attention calls run."""
        decode = step.attn is None or step.attn.is_decode
        return self.decode if decode else self.prefill


def input_hint(inputs: Sequence[Input]) -> str:
    """What to do when a step's inputs made a kernel fail (an index outside its table)."""
    loose = [i.name for i in inputs if not i.dtype.is_floating_point and i.bounds is None]
    if not loose:
        return "Check the step's inputs against the model."
    return (
        f"Integer inputs without bounds: {', '.join(loose)}; an index outside its table "
        "(a token id past the vocabulary, a position past the rotary table) fails so. "
        "Declare Input(..., bounds=(low, high)) (the reference model's inputs() does) so "
        "such a step is refused before anything runs."
    )


class KeyCache:
    """The graphs, eager keys and output buffers of one executor (see the module doc)."""

    def __init__(
        self,
        name: str,
        forward: Any,
        runners: Runners,
        inputs: Sequence[Input],
        entries: dict[tuple, Entry],
        max_tokens: int,
    ) -> None:
        """`entries`: the executor's holdings' dict (released with them); `max_tokens`: the
        output buffers' rows (the largest bucket)."""
        self.name, self.forward, self.runners, self.inputs = name, forward, runners, inputs
        self.entries = entries
        self.max_tokens = max_tokens
        self.eager_keys: dict[tuple, str] = {}  # key -> why its capture failed
        self.eager: Counter = Counter()  # reason -> eager steps
        self.replays = 0
        self._bufs: list[torch.Tensor] | None = None
        self._spec: Any = None
        self._views: dict[int, Any] = {}

    # -- lookup and replay -----------------------------------------------------------------

    def lookup(self, key: tuple) -> Entry | None:
        return self.entries.get(key)

    def store(self, key: tuple, entry: Entry) -> None:
        self.entries[key] = entry

    def replay(self, entry: Entry, step: Staged, hit: bool = True) -> None:
        """Plan the entry's runner on the step's metadata and replay its recording."""
        entry.hits += hit
        self.replays += 1
        try:
            self._replay(entry, step)
        except BaseException as exc:  # no cost on the hot path until a replay fails
            # a failed or interrupted replay's frames (a host-driven graph, the pieces) hold
            # views of graph memory, which close() releases; a traceback printed after it
            # (pytest reprs every frame's arguments) would read them: their locals go, the
            # traceback keeps its lines
            traceback.clear_frames(exc.__traceback__)
            if isinstance(exc, ReplayError):
                raise ReplayError(
                    f"{self.name}: {exc} (key {step.key}). {input_hint(self.inputs)} The graph "
                    "is unchanged and replays valid steps; this step's result is not available."
                ) from exc
            raise

    def _replay(self, entry: Entry, step: Staged) -> None:
        check = step.device_check
        if check is not None:  # device metadata: the key's first piece, its check
            entry.graph.run_check()  # type: ignore[attr-defined]
            check.sent()
        md = step.metadata
        if md is not None:
            runner = self.runners.decode if entry.kind is Kind.FULL else self.runners.prefill
            if runner is not None:
                runner.plan(md)
        entry.graph.replay()

    def outputs(self, n: int) -> Any:
        """The output buffers' views of n tokens (made once per n)."""
        out = self._views.get(n)
        if out is None:
            assert self._bufs is not None
            out = tree_unflatten([b[:n] for b in self._bufs], self._spec)
            self._views[n] = out
        return out

    # -- eager steps -----------------------------------------------------------------------

    def forward_eagerly(
        self,
        views: Mapping[str, torch.Tensor],
        metadata: AttentionMetadata | None,
        runner: AttentionRunner | None,
    ) -> Any:
        """The forward run eagerly, its attention calls through `runner` inline."""
        with torch.no_grad():
            if runner is None or metadata is None:
                return self.forward(**views)
            runner.plan(metadata)
            with step_context(InlineRunner(runner)):
                return self.forward(**views)

    def run_eager(self, step: Staged, device: torch.device) -> Any:
        """An eager step over its own tensors (moved to the device), unpadded."""
        self.eager[step.reason] += 1
        views = {k: v.to(device) for k, v in step.tensors.items()}
        return self.forward_eagerly(views, step.metadata, self.runners.of_eager(step))

    def run_padded(self, step: Staged, reason: str) -> Any:
        """Eager over the staged buffers (a key whose capture failed), sliced to the step."""
        self.eager[reason] += 1
        check = step.device_check
        if check is not None:  # device metadata: checked by the same ops, issued eagerly
            with torch.no_grad():
                check()
            check.sent()
        out = self.forward_eagerly(step.views, step.metadata, self.runners.of_graph(step.kind))
        flat, spec = tree_flatten(out)
        return tree_unflatten([t[: step.num_tokens] for t in flat], spec)

    def mark_eager(self, key: tuple, reason: str) -> None:
        """From now on the key runs eagerly over the staged buffers."""
        self.eager_keys[key] = reason

    # -- output buffers --------------------------------------------------------------------

    def check_outputs(self, result: Any, tb: int) -> list[tuple] | None:
        """Check a forward's outputs (tensors of `tb` rows, the same layout every key); the
        first time, the (shape, dtype, device) of the buffers to allocate."""
        flat, spec = tree_flatten(result)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != tb:
                raise XGraphError(
                    f"{self.name}: every forward output must be a tensor whose first dim is the "
                    f"padded number of tokens ({tb}); got {type(t).__name__} "
                    f"{tuple(getattr(t, 'shape', ()))}."
                )
        if self._bufs is None:
            self._spec = spec
            return [(t.shape[1:], t.dtype, t.device) for t in flat]
        if spec != self._spec or any(
            b.shape[1:] != t.shape[1:] or b.dtype != t.dtype for b, t in zip(self._bufs, flat)
        ):
            raise XGraphError(
                f"{self.name}: the forward's outputs changed structure, shape or dtype between "
                "buckets; they must stay the same."
            )
        return None

    def allocate_outputs(self, layout: list[tuple]) -> None:
        """The output buffers, of the largest bucket's rows."""
        self._bufs = [
            torch.empty((self.max_tokens, *shp), dtype=dt, device=dev) for shp, dt, dev in layout
        ]

    def write_outputs(self, result: Any, tb: int) -> None:
        """Copy a forward's outputs into the buffers (recorded with the forward)."""
        self.check_outputs(result, tb)
        assert self._bufs is not None
        for buf, t in zip(self._bufs, tree_flatten(result)[0]):
            buf[:tb].copy_(t)

    @property
    def has_outputs(self) -> bool:
        """Whether the output buffers exist (the first capture makes them)."""
        return self._bufs is not None

    def output_bytes(self) -> int:
        return sum(b.nbytes for b in self._bufs or [])

    def drop_outputs(self) -> None:
        """Let the output buffers go (with the caller's last view of them)."""
        self._bufs, self._views = None, {}

    # -- reading ---------------------------------------------------------------------------

    def sizes(self) -> tuple[int, int]:
        """(graphs, eager keys): equal on ranks in step."""
        return len(self.entries), len(self.eager_keys)

    def checks(self) -> list[tuple[tuple[int, int], Any]]:
        """((padded sequences, query length), its graph, None where its ops run eagerly) of
        each key whose device check is part of its recording."""
        out = []
        for e in self.entries.values():
            ops = getattr(e.graph, "device_check", None)
            if ops is not None:
                out.append(((ops.seqs, ops.query_len), e.graph.check_graph))  # type: ignore[attr-defined]
        return out

    def hits(self) -> dict[tuple, int]:
        return {k: e.hits for k, e in self.entries.items()}

    def keys(self) -> list[tuple]:
        return sorted(self.entries, key=repr)

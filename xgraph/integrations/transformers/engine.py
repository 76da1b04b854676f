"""The generation loop an engine starts from: continuous batching over a GraphModel.

    engine = Engine(gm)
    engine.add([1, 2, 3], max_new_tokens=32)
    while engine.has_work:
        for event in engine.step():        # tokens as they are chosen (streaming)
            print(event.index, event.token)
        engine.add(...)                    # new prompts join while others decode

Each `step()` is one executor step (scheduler.py): every decoding sequence gets one token
first, then prompts fill the rest of the token budget, a long prompt in chunks; waiting
requests are admitted as seats and cache blocks free up. After the step the LM head runs
on the rows that sample only (the last token of each prompt's final chunk, every decode
token), the sampler chooses their tokens on the device, and the ids come back to the host
in one copy: the step's one host sync, waited on after the step's own host bookkeeping. A
request ends at one of its stop tokens or at max_new_tokens; its blocks go back to the
allocator. Times are host clock readings: a request's time to first token runs from its
`add` to the host having that token, its per-token latencies between its tokens.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...loop_chain import Launch
from ...loop_launch import Sampling
from .allocator import BlockAllocator
from .errors import CapacityError
from .metrics import TokenProgress
from .prompts import token_lists
from .results import GenerationResult, StepModel, graph_step_counts
from .sampling import HostTokens, Sampler, SamplingParams, check_params, device_index
from .scheduler import Batch, SeqState, admit, build_batch, schedule

LOOP_STOP_IDS = 8  # stop tokens a sequence may have for multi-step launches


@dataclass(frozen=True)
class TokenEvent:
    """A token chosen for request `index`; `finished`: it was the request's last."""

    index: int
    token: int
    finished: bool


def stop_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    return frozenset([ids] if isinstance(ids, int) else (ids or ()))


class Engine:
    """Requests in, tokens out, one executor step at a time (module docstring).

    Args:
        gm: a GraphModel.
        record_logits: keep every logit row of every request (for checks; slow).
        max_num_tokens: the step's token budget (default and most: the GraphModel's).
        eos_token_id: stop token(s) of every request, besides each request's own.
        steps_per_launch: K > 1 runs the steps where every sequence decodes as launches of K
            decode steps each (GraphModel.decode_loop: the head, the token choice and the
            next step's inputs on the device; K tokens per sequence reach the host at once);
            steps with a prompt still run one at a time, so requests join between launches.
            While no request waits, the next launch is queued behind the current one before
            its tokens are read back (xgraph.loop_chain), so the device does not wait for
            the host between launches; a request added meanwhile joins one launch later.
            The tokens are the same as with K = 1, greedy or seeded.
    """

    def __init__(
        self,
        gm: StepModel,
        *,
        record_logits: bool = False,
        max_num_tokens: int | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        steps_per_launch: int = 1,
    ) -> None:
        if type(steps_per_launch) is not int or steps_per_launch < 1:
            raise CapacityError(f"steps_per_launch={steps_per_launch!r}; give an int >= 1.")
        self.k = steps_per_launch
        lim = gm.limits
        assert lim.num_blocks is not None and lim.max_model_len is not None
        self.gm, self.record_logits = gm, record_logits
        self.budget = min(max_num_tokens or lim.max_num_tokens, lim.max_num_tokens)
        if self.budget < 1:
            raise CapacityError(f"max_num_tokens={max_num_tokens}: give at least 1.")
        self.eos = stop_set(eos_token_id)
        self.sampler = Sampler(gm.device)
        self.allocator = BlockAllocator(lim.num_blocks)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.requests: list[SeqState] = []
        self.totals: Counter = Counter()
        self.clock: Callable[[], float] = time.perf_counter
        self.progress = TokenProgress(False)
        self._started: float | None = None
        self._counts = graph_step_counts(gm.executor)
        self._ahead: tuple[list[SeqState], Launch] | None = None  # queued, not read back

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ahead)

    def add(
        self,
        prompt: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 16,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: int | Iterable[int] | None = None,
    ) -> int:
        """Queue a request; its index. Refused before it runs (CapacityError, InputError)
        when it could never fit the cache or the model's length."""
        tokens = token_lists([prompt], self.gm.spec.vocab_size)[0]
        index = len(self.requests)
        seq = SeqState(
            index,
            tokens,
            len(tokens),
            max_new_tokens,
            sampling=check_params(sampling if sampling is not None else SamplingParams()),
            stop=self.eos | stop_set(stop_token_ids),
            arrival=self.clock(),
        )
        self._check(seq)
        self.requests.append(seq)
        self.waiting.append(seq)
        self.progress.grow(max_new_tokens)
        return index

    def _check(self, seq: SeqState) -> None:
        lim, i, new = self.gm.limits, seq.index, seq.max_new_tokens
        assert lim.max_model_len is not None and lim.num_blocks is not None
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise CapacityError(f"max_new_tokens must be an int >= 1; got {new!r} for prompt {i}.")
        if not seq.tokens:
            raise CapacityError(f"prompt {i} is empty; give at least one token.")
        if seq.prompt_len + new > lim.max_model_len:
            raise CapacityError(
                f"prompt {i} ({seq.prompt_len} tokens) plus max_new_tokens={new} "
                f"exceeds max_model_len={lim.max_model_len}; shorten it or build the "
                "GraphModel with a larger max_model_len."
            )
        if seq.blocks_needed(lim.block_size) > lim.num_blocks:
            raise CapacityError(
                f"prompt {i} needs {seq.blocks_needed(lim.block_size)} cache blocks, the cache "
                f"has {lim.num_blocks}; build the GraphModel with more num_blocks."
            )

    def step(self) -> list[TokenEvent]:
        """One executor step; the tokens it chose (none while prompts are still in chunks)."""
        if not self.has_work:
            return []
        if self._started is None:
            self._started = self.clock()
        if self._ahead is not None:  # a launch queued behind the last: its tokens first
            seqs, launch = self._ahead
            self._ahead = None
            return self._timed(True, True, lambda: self._collect(seqs, launch))
        lim = self.gm.limits
        admit(self.waiting, self.running, self.allocator, lim.max_seqs, lim.block_size)
        plan = schedule(self.running, self.budget)
        if not plan:  # cannot happen with the checks in add(); never spin
            raise CapacityError(f"{self.gm.spec.name}: no sequence could be scheduled.")
        batch = build_batch(plan, self.gm.cache, self.gm.spec.pad_position)
        launch = self._launchable(batch)
        run = (lambda: self._launch(batch)) if launch else (lambda: self._run(batch))
        return self._timed(batch.is_decode, launch, run)

    def _timed(self, decode: bool, launch: bool, run: Callable[[], list[TokenEvent]]) -> list:
        """Run one step and keep its books: steps, decode steps, time and tokens."""
        t0 = self.clock()
        events = run()
        dt = self.clock() - t0
        self.totals["steps"] += 1
        if decode:
            self.totals["decode_steps"] += self.k if launch else 1
            self.totals["decode_ns"] += int(dt * 1e9)
            self.totals["decode_tokens"] += len(events)
        self.progress.advance(len(events))
        return events

    def _run(self, batch: Batch) -> list[TokenEvent]:
        """The step, the head on the rows that sample, the sampler; then the host's part."""
        out = self.gm.step(batch.input_ids, batch.positions, batch.attn)
        ready = [c for c in batch.chunks if c.seq.pending == c.length]
        rows = [c.start + c.length - 1 for c in ready]
        every = len(rows) == out.shape[0] == batch.input_ids.shape[0]
        index = None if every or not rows else device_index(rows, out.device)
        host: HostTokens | None = None
        if self.record_logits:
            logits = self.gm.logits(out)
            for c in batch.chunks:  # a copy: the step's outputs are overwritten next step
                rows_of = logits[c.start : c.start + c.length]
                c.seq.logits.append(rows_of.to("cpu", torch.float32, copy=True))
            logits = logits if index is None else logits.index_select(0, index)
        elif rows:
            logits = self.gm.logits(out, index)
        if rows:
            params = [c.seq.sampling for c in ready]
            at = [len(c.seq.tokens) for c in ready]  # where each chosen token will stand
            host = HostTokens(self.sampler(logits, params, at))
        for c in batch.chunks:  # host work while the device finishes the step
            c.seq.computed += c.length
        if host is None:
            return []
        return self._finish(ready, host.get())

    def _finish(self, ready: list[Any], tokens: list[int]) -> list[TokenEvent]:
        return self._take([c.seq for c in ready], [[t] for t in tokens])

    def _take(self, seqs: list[SeqState], tokens: list[list[int]]) -> list[TokenEvent]:
        """Each sequence's new tokens on the host, in order; a sequence ends at a stop token
        or at max_new_tokens, and gives its blocks back."""
        now = self.clock()
        events = []
        for seq, new in zip(seqs, tokens):
            for token in new:
                seq.tokens.append(token)
                seq.token_times.append(now)
                if token in seq.stop:
                    seq.finish_reason = "stop"
                elif seq.generated >= seq.max_new_tokens:
                    seq.finish_reason = "length"
                seq.done = bool(seq.finish_reason)
                events.append(TokenEvent(seq.index, token, seq.done))
                if seq.done:
                    self.allocator.release(seq.blocks)
                    self.running.remove(seq)
                    self.progress.grow(seq.generated - seq.max_new_tokens)  # stopped early
                    break
        return events

    def _launchable(self, batch: Batch) -> bool:
        """Whether this step runs as a launch of K decode steps: every sequence decodes, and
        the loop can keep its positions (models that count positions past padding cannot)
        and its stop tokens."""
        return (
            self.k > 1
            and batch.is_decode
            and not self.record_logits
            and self.gm.spec.pad_position is None
            and all(len(c.seq.stop) <= LOOP_STOP_IDS for c in batch.chunks)
        )

    def _launch(self, batch: Batch) -> list[TokenEvent]:
        """K decode steps in one launch; each sequence's new tokens come back together."""
        seqs = [c.seq for c in batch.chunks]
        ps = [s.sampling for s in seqs]
        sampling = None
        if not all(p.greedy for p in ps):
            sampling = Sampling(
                temperature=[p.temperature for p in ps],
                top_k=[p.top_k for p in ps],
                top_p=[p.top_p for p in ps],
                seeds=[p.seed for p in ps],
            )
        launch = self.gm.decode_loop(self.k).launch(
            batch.input_ids,
            batch.positions,
            batch.attn,
            budget=[s.max_new_tokens - s.generated for s in seqs],
            stop_ids=[sorted(s.stop) for s in seqs],
            sampling=sampling,
        )
        return self._collect(seqs, launch)

    def _collect(self, seqs: list[SeqState], launch: Launch) -> list[TokenEvent]:
        """A launch's tokens, the next launch queued behind it first where no request waits
        and a sequence will still run after it (its budget outlasts this launch)."""
        alive = [s for s in seqs if not s.done]  # a chained launch's may have finished
        outlast = any(s.max_new_tokens - s.generated > self.k for s in alive)
        if outlast and not self.waiting and self.gm.decode_loop(self.k).chains:
            self._ahead = (seqs, launch.then())
            self.totals["queued_launches"] += 1
        out = launch.result()
        if "blocks" in out.reasons:  # admission reserved every block a sequence can need
            raise CapacityError("a decode launch ran out of cache blocks it was given.")
        new = dict(zip(map(id, seqs), out.tokens))
        for seq in alive:
            seq.computed += len(new[id(seq)])  # the input token and each new one but the last
        return self._take(alive, [new[id(s)] for s in alive])

    def events(self) -> Iterator[TokenEvent]:
        """Steps until every request has finished, yielding tokens as they are chosen."""
        while self.has_work:
            yield from self.step()

    def run(
        self,
        on_token: Callable[[TokenEvent], Any] | None = None,
        progress: bool = False,
    ) -> GenerationResult:
        """Run every request to its end (`on_token` sees each token as it is chosen, and
        may add requests); the result of every request added so far."""
        self.progress = TokenProgress(progress)
        self.progress.grow(sum(s.max_new_tokens - s.generated for s in self.waiting))
        self.progress.grow(sum(s.max_new_tokens - s.generated for s in self.running))
        try:
            for event in self.events():
                if on_token is not None:
                    on_token(event)
        finally:
            self.progress.close()
        return self.result()

    def result(self) -> GenerationResult:
        """Tokens, timings and latencies of every request added so far."""
        after = graph_step_counts(self.gm.executor)
        seqs = self.requests
        end = max((s.token_times[-1] for s in seqs if s.token_times), default=self.clock())
        start = min((s.arrival for s in seqs), default=end)
        return GenerationResult(
            tokens=[s.tokens[s.prompt_len :] for s in seqs],
            prompt_tokens=sum(s.prompt_len for s in seqs),
            steps=self.totals["steps"],
            seconds=end - start,
            decode_steps=self.totals["decode_steps"],
            decode_seconds=self.totals["decode_ns"] / 1e9,
            decode_tokens=self.totals["decode_tokens"],
            graph_steps={k: after[k] - self._counts[k] for k in ("full", "piecewise", "eager")},
            logits=[torch.cat(s.logits) for s in seqs] if self.record_logits else None,
            ttft=[s.token_times[0] - s.arrival for s in seqs if s.token_times],
            per_token=[b - a for s in seqs for a, b in zip(s.token_times, s.token_times[1:])],
            finish_reasons=[s.finish_reason for s in seqs],
            times=[list(s.token_times) for s in seqs],
        )

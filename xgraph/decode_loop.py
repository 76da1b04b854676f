"""DecodeLoop: K decode steps per launch, the loop kept on the device.

    loop = DecodeLoop(model.forward_logits, attention=attn, steps=8, inputs=model.inputs())
    out = loop(input_ids, positions, attn_inputs, budget=[32, 32], stop_ids=[[eos], [eos]],
               free_blocks=[7, 8, 9])
    out.tokens        # up to 8 new tokens per sequence, as one host read

An engine loop that samples on the host pays the host's time between every two tokens.
Here one launch runs K decode steps: after each step the next token is chosen on the device
(greedy, or seeded sampling whose draws depend only on (seed, position, token id):
xgraph.device_sampling), and the step feedback (xgraph.feedback) writes it into the next
step's inputs with the position, the sequence length and the cache slot, taking new cache
blocks from a list the host hands over; finished sequences (stop token, budget spent, no
block left) keep running over what they had and write only the dummy slot. The host reads
the K tokens of every sequence back at the end of the launch.

Each launch is one step of an executor (xgraph.GraphExecutor) whose forward is the K-step
loop: it is bucketed, padded, captured on the first miss and replayed after like any full
decode graph (padded sequences get a budget of 0, so they start finished). Greedy launches
and sampling launches are two executors over one graph memory (a greedy graph skips the
sort that top-k and top-p need). The loop runs unrolled: K copies of the step in one
graph, on every backend.

The step function is the model's decode step returning logits for every token (`step(
input_ids=..., positions=...)`), with `xgraph.attention` inside, and it is called K times
per launch. Every launch starts from what the host staged: the loop puts every buffer it
advanced back at its end, so a launch is a function of its inputs (the executor runs the
forward eagerly once before capturing it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .buckets import Buckets, Input
from .errors import InputError, XGraphError
from .executor import GraphExecutor
from .feedback import RUNNING, Feedback, LoopBuffers
from .interfaces import AttentionRunner, Backend
from .loop_chain import Chain, Launch, refuse_eager
from .loop_launch import SAMPLING, LoopResult, Sampling, launch_free, launch_inputs, sampling_inputs
from .loop_step import StepTail
from .memory import GraphMemory
from .metadata import AttentionInputs, AttentionMetadata, KVCache, LaunchState
from .options import Mode
from .paging import PagedAttention
from .plugins import get_backend
from .runners import reference_runners


class _Tap(AttentionRunner):
    """The decode runner, keeping the metadata it is planned on: the loop advances those
    device buffers between its steps, and the runner reads them in each."""

    graph_safe = True

    def __init__(self, inner: AttentionRunner) -> None:
        if not inner.graph_safe:
            raise XGraphError(
                f"DecodeLoop: the decode runner {type(inner).__name__} is not graph-safe; "
                "several decode steps in one launch need one that reads every per-step "
                "value from device buffers."
            )
        self.inner = inner
        self.metadata: AttentionMetadata | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self.inner.plan(metadata)

    def forget(self) -> None:
        self.metadata = None
        self.inner.forget()

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
    ) -> None:
        self.inner.run(q, k, v, out, kv_cache, scale)


class _Loop:
    """The executor's forward: K steps, each followed by the choice and the feedback."""

    def __init__(self, owner: DecodeLoop, sampled: bool) -> None:
        self.owner, self.sampled = owner, sampled

    def __call__(self, **x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = self.owner
        md = o.tap.metadata
        if md is None:
            raise XGraphError("DecodeLoop: the decode runner was not planned for this launch.")
        names = ("input_ids", "positions", "budget", "stop_ids", "free_blocks", "free_count")
        buf = LoopBuffers(*(x[n] for n in names), md=md)
        a = o.attention
        fb = Feedback(buf, a.block_size, a.dummy_block, a.dummy_slot)
        outs = []
        for _ in range(o.steps):
            logits = o.step(input_ids=buf.input_ids, positions=buf.positions)
            if self.sampled:
                params = (x["temperature"], x["top_k"], x["top_p"], x["seeds"])
                outs.append(o.tail.choose_sampled(logits, fb, params, o.vocab(logits)))
            else:
                outs.append(o.tail.choose_greedy(logits, fb))
        n, live = buf.seqs, fb.reasons == RUNNING
        # where each sequence stands now: the start of a launch queued behind this one
        state = (
            buf.input_ids,
            buf.positions,
            torch.where(live, buf.budget - fb.generated, 0),
            md.seq_lens[:n].long(),
            md.slot_mapping[:n],
        )
        result = (
            torch.stack(outs, 1),
            fb.generated.clone(),
            fb.reasons.clone(),
            fb.tables(),
            torch.stack(state, 1),
        )
        fb.restore()
        return result


class DecodeLoop:
    """K decode steps per launch over a paged KV cache (see the module docstring).

    Args:
        step: the model's decode step, `step(input_ids=, positions=) -> logits [tokens, V]`.
        attention: the cache's paging layout (PagedAttention.for_cache); its decode runner
            (or the backend's) must be graph-safe.
        steps: K, the decode steps per launch (>= 1).
        backend, buckets, memory, compiled, name: as GraphExecutor's (`memory` may be another
            executor's GraphMemory: the loop's graphs then share its physical memory).
        compiler: None (the choice and the feedback eager), or a torch.compile backend
            ("inductor") they run under after each step (xgraph.loop_step; GraphModel(
            compile=...) passes its own). Implies `compiled`.
        tail: the choice and the feedback to run (a StepTail of this cache's layout), shared
            with other loops, whose compiled code then serves them all (GraphModel's loops of
            every K share one; `compiler` is then not used); default: a StepTail of its own
            under `compiler`.
        mode: the executor's mode: "full" (default: every launch a graph) or "eager"
            (every launch runs the loop eagerly, the compiled code included).
        inputs: the model's declared inputs, for the bounds of input_ids and positions
            (`Qwen3Model.inputs()`); others are the loop's own.
        max_stop_ids: the most stop tokens one sequence has.
        max_free_blocks: the most blocks one launch may hand out (default: one per sequence
            and per block the K steps can cross).
    """

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        *,
        attention: PagedAttention,
        steps: int,
        backend: str | Backend | None = None,
        buckets: Buckets | Sequence[int] | None = None,
        memory: GraphMemory | str | None = None,
        inputs: Sequence[Input] = (),
        max_stop_ids: int = 4,
        max_free_blocks: int | None = None,
        compiled: bool = False,
        compiler: str | Callable[..., Any] | None = None,
        tail: StepTail | None = None,
        mode: Mode | str = Mode.FULL,
        name: str = "decode-loop",
    ) -> None:
        if type(steps) is not int or steps < 1:
            raise XGraphError(f"DecodeLoop: steps={steps!r}; give an int >= 1 (K per launch).")
        if attention.max_query_len != 1:
            raise XGraphError(
                "DecodeLoop: decode steps carry one token per sequence: give a "
                "PagedAttention with max_query_len=1."
            )
        self.step, self.steps, self.name = step, steps, name
        self.backend = get_backend(backend)
        self.buckets = Buckets.of(buckets, 256)
        inner = (
            attention.decode_runner
            or {**reference_runners(), **self.backend.kernels().attention}["decode"]
        )
        self.tap = _Tap(inner)
        self.attention = dataclasses.replace(attention, decode_runner=self.tap)
        self.max_stop_ids = max_stop_ids
        per_seq = -(-steps // attention.block_size) + 1
        self.max_free_blocks = max_free_blocks or self.buckets.max * per_seq
        self.memory = GraphMemory.of(self.backend, memory)
        self._owns_memory = not isinstance(memory, GraphMemory)
        self._bounds = {i.name: i.bounds for i in inputs}
        self.mode = Mode.parse(mode, "mode")
        if self.mode not in (Mode.FULL, Mode.EAGER):
            raise XGraphError(f"DecodeLoop: mode={mode!r}; give 'full' or 'eager'.")
        self.tail = self._tail(tail, compiler)
        self.compiled = compiled or bool(self.tail.compiled)
        self._executors: dict[bool, GraphExecutor] = {}
        self._vocab: torch.Tensor | None = None

    def _tail(self, tail: StepTail | None, compiler: Any) -> StepTail:
        """The given StepTail, checked against this cache's layout, or one of its own."""
        a = self.attention
        layout = (a.block_size, a.dummy_block, a.dummy_slot)
        if tail is None:
            return StepTail(
                block_size=a.block_size,
                dummy_block=a.dummy_block,
                dummy_slot=a.dummy_slot,
                compiler=compiler,
                max_seqs=self.buckets.max,
                name=self.name,
            )
        if tail.layout != layout:
            raise XGraphError(
                f"DecodeLoop: tail= is a StepTail of the layout {tail.layout} (block size, "
                f"dummy block, dummy slot); this cache's is {layout}. Give one made for it."
            )
        return tail

    @property
    def chains(self) -> bool:
        """Whether a launch can queue the next behind it (Launch.then): full graphs only."""
        return self.mode is Mode.FULL

    def vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """arange(V) for logits of width V on their device (the sampler's token ids), made
        at the first launch's eager run, never inside a capture."""
        v = self._vocab
        if v is None or v.device != logits.device or v.shape[0] != logits.shape[-1]:
            v = self._vocab = torch.arange(logits.shape[-1], device=logits.device)
        return v

    def _inputs(self, sampled: bool) -> list[Input]:
        i64 = torch.int64
        out = [
            # bounds checked by the loop on the host values (_check_bounds): a chained
            # launch's are on the device, where a check would wait for the launch before
            Input("input_ids", i64, ("num_tokens",)),
            Input("positions", i64, ("num_tokens",)),
            Input("budget", i64, ("num_tokens",), fill=0),  # padding: finished from the start
            Input("stop_ids", i64, ("num_tokens", self.max_stop_ids), fill=-1),
            Input("free_blocks", i64, (self.max_free_blocks,)),
            Input("free_count", i64, (1,)),
        ]
        if sampled:
            out += [
                Input("seeds", i64, ("num_tokens",)),
                Input("temperature", torch.float32, ("num_tokens",)),
                Input("top_k", i64, ("num_tokens",)),
                Input("top_p", torch.float32, ("num_tokens",), fill=1.0),
            ]
        return out

    def executor(self, sampled: bool = False) -> GraphExecutor:
        """The executor of greedy (or sampling) launches, made at its first use."""
        ex = self._executors.get(sampled)
        if ex is None:
            ex = self._executors[sampled] = GraphExecutor(
                _Loop(self, sampled),
                inputs=self._inputs(sampled),
                backend=self.backend,
                buckets=self.buckets,
                attention=self.attention,
                memory=self.memory,
                mode=self.mode,
                compiled=self.compiled,
                name=f"{self.name}-{'sample' if sampled else 'greedy'}",
            )
        return ex

    def capture(self, sizes: Sequence[int] | None = None, sampled: bool = False) -> None:
        """Capture the launches of these sequence counts before serving (every bucket by
        default), over the dummy block only."""
        self.executor(sampled).capture(sizes, kind="full")

    def __call__(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        attn: AttentionInputs,
        *,
        budget: int | Sequence[int],
        stop_ids: Sequence[Sequence[int]] | None = None,
        free_blocks: Sequence[int] = (),
        sampling: Sampling | None = None,
    ) -> LoopResult:
        """One launch: up to K new tokens for each sequence of a decode step.

        input_ids, positions, attn: the decode step as GraphExecutor takes it (one token per
        sequence: its last token, that token's position, seq_lens counting it). budget: how
        many tokens each sequence may still produce. stop_ids: each sequence's stop tokens.
        free_blocks: cache blocks the launch may give, in order, to sequences that cross
        into a column of their block-table row that holds no block (the engine has taken
        them from its allocator; those not given stay the engine's). sampling: None or
        temperature 0 everywhere is greedy.
        """
        return self.launch(
            input_ids,
            positions,
            attn,
            budget=budget,
            stop_ids=stop_ids,
            free_blocks=free_blocks,
            sampling=sampling,
        ).result()

    def launch(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        attn: AttentionInputs,
        *,
        budget: int | Sequence[int],
        stop_ids: Sequence[Sequence[int]] | None = None,
        free_blocks: Sequence[int] = (),
        sampling: Sampling | None = None,
    ) -> Launch:
        """The launch `__call__` runs, queued: `.result()` reads it back, `.then()` queues
        the next launch of the same sequences behind it (xgraph.loop_chain)."""
        sampled, x = self.prepare(
            input_ids,
            positions,
            attn,
            budget=budget,
            stop_ids=stop_ids,
            free_blocks=free_blocks,
            sampling=sampling,
        )
        n = len(attn.query_lens)
        reused = {k: x[k] for k in ("stop_ids", *SAMPLING) if k in x}
        first = (x["positions"].cpu().numpy(), x["budget"].cpu().numpy())
        free = frozenset(int(b) for b in free_blocks)
        chain = Chain(n, self.steps, *first, depth=0, reused=reused, free=free)
        return self._queue(sampled, x, chain, attn.block_tables)

    def _queue(
        self, sampled: bool, x: dict, chain: Chain, before: Sequence[Sequence[int]] | Launch
    ) -> Launch:
        """Run a launch through its executor; the queued Launch (`before`: the rows it
        started from, or the launch it follows)."""
        out = self.executor(sampled)(**x)
        a = self.attention
        queue = functools.partial(self._follow, sampled)
        return Launch(queue, out, chain, before, a.dummy_block, a.max_blocks_per_seq)

    def _follow(
        self, sampled: bool, chain: Chain, attn: LaunchState, x: dict, free: list, prior: Launch
    ) -> Launch:
        """Queue the launch `prior.then()` asked for (xgraph.loop_chain)."""
        if not self.chains:
            raise refuse_eager(self.name)
        worst, bound = chain.worst_position(), self._bounds.get("positions")
        if bound is not None and worst >= bound[1]:
            raise InputError(
                f"DecodeLoop: a chained launch could feed position {worst}, past the model's "
                f"bound {bound[1]}; read this launch back and start the next one."
            )
        x.update(chain.reused, **launch_free(free, self.attention, self.max_free_blocks))
        return self._queue(sampled, {"attn": attn, **x}, chain, prior)

    def prepare(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        attn: AttentionInputs,
        *,
        budget: int | Sequence[int],
        stop_ids: Sequence[Sequence[int]] | None = None,
        free_blocks: Sequence[int] = (),
        sampling: Sampling | None = None,
    ) -> tuple[bool, dict[str, Any]]:
        """A launch's arguments checked: whether it samples (its executor), and the
        executor's keyword arguments (`attn` among them)."""
        n = len(attn.query_lens)
        sizes = {"stop": self.max_stop_ids, "free": self.max_free_blocks}
        x = launch_inputs(self.attention, attn, positions, budget, stop_ids, free_blocks, sizes)
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        pos = torch.as_tensor(positions, dtype=torch.int64)
        self._check_bounds("input_ids", ids)
        self._check_positions(pos, x["budget"])
        sampled = sampling is not None and not sampling.greedy
        if sampled:
            assert sampling is not None
            x.update(sampling_inputs(sampling, n))
        if self.mode is Mode.EAGER:  # fresh metadata: its rows need every column, as staged
            a = self.attention
            table = attn.table(a.dummy_block, a.max_blocks_per_seq)
            attn = AttentionInputs(attn.query_lens, attn.seq_lens, table, attn.slot_mapping)
        return sampled, {"attn": attn, "input_ids": ids, "positions": pos, **x}

    def _check_bounds(self, name: str, v: torch.Tensor) -> None:
        """A host value outside the model's declared bounds refused, named (a device tensor
        pays one sync here)."""
        bound = self._bounds.get(name)
        if bound is None or not v.numel():
            return
        low, high = bound
        bad = ((v < low) | (v >= high)).nonzero()
        if len(bad):
            at = int(bad[0, 0])
            raise InputError(
                f"DecodeLoop: input {name!r}[{at}] is {int(v[at])}, outside its bounds "
                f"[{low}, {high})."
            )

    def _check_positions(self, pos: torch.Tensor, budget: torch.Tensor) -> None:
        """Every position a launch feeds the model stays inside the model's bound."""
        bound = self._bounds.get("positions")
        if bound is None or not len(pos):
            return
        last = pos.cpu() + torch.clamp(budget, max=self.steps) - 1
        worst = int(last.max())
        if worst >= bound[1]:
            raise InputError(
                f"DecodeLoop: a launch would feed position {worst}, past the model's bound "
                f"{bound[1]}; lower that sequence's budget."
            )

    def stats(self) -> dict[str, Any]:
        """Each executor's stats, by "greedy" and "sample" (the compiled choice and
        feedback's: `tail.stats()`)."""
        return {("sample" if k else "greedy"): ex.stats() for k, ex in self._executors.items()}

    def close(self) -> None:
        """Close the loop's executors, then its graph memory if it is the loop's own."""
        for ex in self._executors.values():
            ex.close()
        self._executors.clear()
        if self._owns_memory:
            self.memory.close()

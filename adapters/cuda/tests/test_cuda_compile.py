"""The executor over a torch.compile'd forward on CUDA, against eager, in bf16 (GPU only).

Same weights three ways: float32 eager (the reference), bf16 through the executor over the
eager forward, bf16 through the executor over `compile_layers()` (`compiled=True`). The
compiled path may round differently from the eager one, but must not be further from
float32 than twice the eager bf16 path's distance: the rule docs/transformers.md uses.
A prefill step runs piecewise, the decode steps as full graphs.
"""

from __future__ import annotations

import random

import torch

from xgraph import AttentionInputs, Buckets
from xgraph.models import Step, Workload

BUCKETS = [1, 2, 4, 8, 16, 32]


def _workload(dtype: torch.dtype) -> Workload:
    return Workload.tiny(device="cuda", dtype=dtype, num_blocks=64, max_blocks=8, max_seqs=8)


def _steps(w: Workload) -> list[Step]:
    """A prefill of two prompts, then three decode steps continuing both sequences."""
    rng = random.Random(7)
    steps = [w.prefill_step(rng, [9, 5])]  # block size 4: room for three more tokens each
    rows = [list(r) for r in steps[0].attn.block_tables]
    for i in range(3):
        seq_lens = [n + 1 + i for n in steps[0].attn.seq_lens]
        pos = [n - 1 for n in seq_lens]
        slots = [w.cache.slot(r, p) for r, p in zip(rows, pos)]
        ids = torch.tensor([rng.randrange(w.vocab) for _ in pos])
        steps.append(Step(ids, torch.tensor(pos), AttentionInputs([1, 1], seq_lens, rows, slots)))
    return steps


def test_compiled_forward_matches_eager_within_bf16_rounding(backend):
    ref = _workload(torch.float32)
    eager, comp = _workload(torch.bfloat16), _workload(torch.bfloat16)
    comp.model.compile_layers()
    ex_e = eager.executor(backend=backend, buckets=BUCKETS, on_capture_error="raise")
    ex_c = comp.executor(backend=backend, buckets=BUCKETS, compiled=True, on_capture_error="raise")
    for step in _steps(ref):
        expected = ref.eager(ref.padded(step, Buckets(BUCKETS), full=step.attn.is_decode))
        expected = expected[: step.num_tokens].float()
        e = ex_e(**step.kwargs(), clone=True).float()
        c = ex_c(**step.kwargs(), clone=True).float()
        e_err = (e - expected).abs().max().item()
        c_err = (c - expected).abs().max().item()
        assert c_err <= 2 * e_err + 1e-3, (step.attn.query_lens, c_err, e_err)
    kinds = {k[0] for k in ex_c.stats()["keys"]}
    assert kinds == {"full", "piecewise"}, ex_c.stats()["keys"]
    ex_e.close()
    ex_c.close()

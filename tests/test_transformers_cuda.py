"""GraphModel(compile=True) on CUDA with Inductor (GPU only; skipped without one).

The same checks as the CPU tests, where only a GPU runs them: Inductor's kernels inside
xgraph's CUDA graphs, full and piecewise, the attention custom op running the Triton
runners inline and between pieces, the projections through the decode projection kernel with
q/k/v and gate/up merged. float32, so the tokens must be transformers' own; then bf16
against the float32 rule of docs/transformers.md (no farther from float32 than twice
transformers' own bf16 logits).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

import xgraph  # noqa: E402
from xgraph.buckets import vllm_capture_sizes  # noqa: E402
from xgraph.integrations.transformers import GraphModel  # noqa: E402
from xgraph.integrations.transformers.linears import XLinear  # noqa: E402

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)
LIMITS = dict(block_size=16, max_model_len=128, max_seqs=4, max_num_tokens=64)


def compiled(model: torch.nn.Module, backend: object, **kwargs: object) -> GraphModel:
    """A GraphModel over `model` with its decoder compiled whole, its layers fused or not
    (these tests are about the compile; the default scope leaves fused layers uncompiled)."""
    options = dict(compile=True, compile_scope="forward", on_capture_error="raise")
    return GraphModel(model, backend=backend, **options, **{**LIMITS, **kwargs})


@pytest.fixture
def backend():  # type: ignore[no-untyped-def]
    try:
        return xgraph.get_backend("cuda")
    except xgraph.BackendUnavailableError as exc:
        pytest.skip(str(exc))


def tiny(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG))
    return model.to("cuda", dtype).eval().requires_grad_(False)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(CONFIG["vocab_size"]) for _ in range(n)] for n in (90, 17, 5, 33)]


def hf_greedy(model: torch.nn.Module, ps: list[list[int]], new: int) -> list[list[int]]:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    out = []
    for p in ps:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            got = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(got[0, len(p) :].tolist())
    return out


def test_inductor_compiled_decoder_in_cuda_graphs_gives_transformers_tokens(backend):
    torch._dynamo.reset()
    counters.clear()
    model = tiny(torch.float32)
    ps = prompts()
    want = hf_greedy(model, ps, 12)
    with compiled(model, backend) as gm:
        assert any(type(m) is XLinear for m in model.modules())  # the projection kernel serves
        result = gm.generate(ps, 12)
        stats = gm.stats()
    assert result.tokens == want
    g = result.graph_steps
    assert g["full"] > 0 and g["piecewise"] > 0 and g["eager"] == 0
    assert stats["compile"]["compiles"] == 2 and stats["compile"]["fullgraph"]
    assert stats["compile"]["fallback"] is None
    assert dict(counters["graph_break"]) == {}


def test_bf16_compiled_logits_are_as_close_to_float32_as_transformers(backend):
    torch._dynamo.reset()
    model = tiny(torch.bfloat16)
    exact = copy.deepcopy(model).float()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ps = prompts()
    with compiled(model, backend) as gm:
        result = gm.generate(ps, 8, record_logits=True, max_num_tokens=32)
    assert result.logits is not None
    for p, tokens, got in zip(ps, result.tokens, result.logits):
        ids = torch.tensor([p + tokens[:-1]], device="cuda")
        with torch.no_grad():
            truth = exact(input_ids=ids).logits[0].float().cpu()
            theirs = ref(input_ids=ids).logits[0].float().cpu()
        ours = (got - truth).abs().max().item()
        assert ours <= 2 * (theirs - truth).abs().max().item() + 1e-3


def test_every_vllm_decode_size_captures_over_two_compiles(backend):
    torch._dynamo.reset()
    model = tiny(torch.bfloat16)
    sizes = vllm_capture_sizes(64)
    limits = dict(max_seqs=64, num_blocks=64)
    with compiled(model, backend, buckets=sizes, **limits) as gm:
        gm.executor.capture(sorted(sizes, reverse=True), kind="full", progress=False)
        stats = gm.stats()
    assert stats["captures"] == len(sizes)
    assert stats["compile"]["compiles"] == 2 and stats["compile"]["sizes"] == sorted(sizes)


def test_the_decode_kernels_fuse_the_layers_and_stay_close_to_float32(backend, monkeypatch):
    monkeypatch.setenv("XGRAPH_CUDA_LINEAR", "triton")  # the fused kernels (docs/kernels.md)
    monkeypatch.setenv("XGRAPH_FUSE_LAYERS", "1")
    torch._dynamo.reset()
    counters.clear()
    model = tiny(torch.bfloat16)
    exact = copy.deepcopy(model).float()
    ps = prompts()
    with compiled(model, backend) as gm:
        assert gm.fused  # every layer over the fused projections (fusions.py)
        result = gm.generate(ps, 8, record_logits=True, max_num_tokens=32)
    assert dict(counters["graph_break"]) == {}
    assert result.logits is not None and result.graph_steps["eager"] == 0
    for p, tokens, got in zip(ps, result.tokens, result.logits):
        ids = torch.tensor([p + tokens[:-1]], device="cuda")
        with torch.no_grad():
            truth = exact(input_ids=ids).logits[0].float().cpu()
            theirs = model(input_ids=ids).logits[0].float().cpu()  # given back: its own
        ours = (got - truth).abs().max().item()
        assert ours <= 2 * (theirs - truth).abs().max().item() + 1e-3

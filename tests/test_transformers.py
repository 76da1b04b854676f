"""Hugging Face transformers models through xgraph, unmodified (CPU backend, float32).

Tiny randomly initialised configs of several families (hf_tiny.py), built from transformers'
own config classes: every logit of a multi-sequence chunked-prefill + decode run through the
executor must match transformers' full-sequence forward (sdpa); host reads inside the
model are named at capture and run eagerly under the eager policy; `xgraph generate` runs
on a model folder saved by a fixture.
"""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

from hf_tiny import FAMILIES, LIMITS, TINY, tiny  # noqa: E402

import xgraph  # noqa: E402
from xgraph.cli import main as xgraph_main  # noqa: E402
from xgraph.integrations.transformers import (  # noqa: E402
    BlockAllocator,
    CapacityError,
    GraphModel,
    ModelFolderError,
    SamplingParams,
    UnsupportedModelError,
)

PROMPT_LENS = (13, 5, 29, 9, 3)  # 5 prompts over 4 seats: one waits; 29 > 16: chunked
NEW_TOKENS = [6, 3, 8, 5, 4]  # sequences finish at different steps: decode batches shrink


def prompts(seed: int = 0, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lens]


def reference_logits(ref: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([tokens])).logits[0]


def assert_matches_reference(ref: torch.nn.Module, ps: list[list[int]], result) -> None:
    """Every recorded logit row (every token of every step) against the sdpa forward."""
    assert result.logits is not None
    for p, generated, got in zip(ps, result.tokens, result.logits):
        want = reference_logits(ref, p + generated[:-1])
        assert got.shape == want.shape  # one row per token the model ran, none missing
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def sdpa_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    return ref


# -- the families ------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_and_decode_match_transformers(family):
    model = tiny(family)
    ref = sdpa_copy(model)
    ps = prompts()
    with GraphModel(model, backend="cpu", on_capture_error="raise", **LIMITS) as gm:
        result = gm.generate(ps, max_new_tokens=NEW_TOKENS, record_logits=True)
        stats = gm.stats()
    assert_matches_reference(ref, ps, result)
    assert [len(t) for t in result.tokens] == NEW_TOKENS
    g = result.graph_steps
    hits = {
        kind: sum(n for k, n in stats["hits"].items() if k[0] == kind)
        for kind in ("full", "piecewise")
    }
    print(
        f"\n{family}: {result.steps} steps: {g['full']} replayed full graphs, "
        f"{g['piecewise']} replayed piecewise graphs, {g['eager']} eager; cache hits {hits}"
    )
    assert g["full"] > 0 and g["piecewise"] > 0 and g["eager"] == 0
    assert g["full"] + g["piecewise"] == result.steps
    assert hits["full"] > 0 and hits["piecewise"] > 0  # graphs replayed after their capture
    assert model.config._attn_implementation == "sdpa"  # close() gave it back


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny("qwen3")
    ps = prompts(3, (7, 11))
    with GraphModel(model, backend="cpu", **LIMITS) as gm:
        greedy = gm.generate(ps, 8).tokens
        top1 = gm.generate(ps, 8, sampling=SamplingParams(temperature=1.0, top_k=1)).tokens
        hot = SamplingParams(temperature=2.0, seed=7)
        a, b = gm.generate(ps, 8, sampling=hot).tokens, gm.generate(ps, 8, sampling=hot).tokens
    assert top1 == greedy
    assert a == b
    assert all(0 <= t < TINY["vocab_size"] for seq in a for t in seq)


def test_pre_capture_leaves_nothing_to_capture_while_generating():
    with GraphModel(tiny("gemma"), backend="cpu", on_capture_error="raise", **LIMITS) as gm:
        gm.capture()
        keys = set(gm.stats()["keys"])  # decode up to max_seqs, prefill every bucket
        assert keys == {
            ("full", 1),
            ("full", 2),
            ("full", 4),
            ("piecewise", 1),
            ("piecewise", 2),
            ("piecewise", 4),
            ("piecewise", 8),
            ("piecewise", 16),
        }
        result = gm.generate(prompts(5), NEW_TOKENS)
        assert gm.stats()["captures"] == len(keys) and result.graph_steps["eager"] == 0


def test_eos_stops_a_sequence_early():
    model = tiny("llama")
    ps = prompts(4, (6, 6))
    with GraphModel(model, backend="cpu", **LIMITS) as gm:
        free = gm.generate(ps, 8).tokens
        stop = free[0][2]
        early = gm.generate(ps, 8, eos_token_id=stop).tokens
    assert early[0] == free[0][: free[0].index(stop) + 1]


# -- refusals ---------------------------------------------------------------------------


def test_sliding_window_shorter_than_the_context_is_refused():
    model = tiny("mistral", sliding_window=16)
    with pytest.raises(
        UnsupportedModelError,
        match=r"MistralForCausalLM.*window 16.*"
        r"max_model_len <= 16",
    ):
        GraphModel(model, backend="cpu", **LIMITS)
    assert model.config._attn_implementation != "xgraph"  # refused before switching


def test_soft_capped_attention_is_refused():
    config = transformers.Gemma2Config(**TINY, sliding_window=64)
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM.*attn_logit_softcapping"):
        GraphModel(transformers.Gemma2ForCausalLM(config), backend="cpu", **LIMITS)


def test_a_layer_of_its_own_shape_gets_a_cache_layer_of_that_shape():
    model = tiny("llama")
    odd = tiny("llama", num_key_value_heads=1).model.layers[1].self_attn  # 1 kv head, not 2
    model.model.layers[1].self_attn = odd
    # with a config of its own it would call its own attention: refused before any step
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn.*bypass"):
        GraphModel(model, backend="cpu", **LIMITS)
    assert model.config._attn_implementation == "sdpa"  # given back
    odd.config = model.config  # routed through xgraph: the probe sees its own shape
    ref = sdpa_copy(model)
    ps = prompts()
    with GraphModel(model, backend="cpu", on_capture_error="raise", **LIMITS) as gm:
        assert [tuple(k.shape[2:]) for k, _ in gm.cache.layers] == [(2, 16), (1, 16)]
        result = gm.generate(ps, NEW_TOKENS, record_logits=True)
    assert_matches_reference(ref, ps, result)


def test_calling_the_model_outside_a_step_says_what_to_do():
    model = tiny("qwen3")
    with GraphModel(model, backend="cpu", **LIMITS), torch.no_grad():
        with pytest.raises(xgraph.XGraphError, match="outside a GraphModel step"):
            model(input_ids=torch.tensor([[1, 2, 3]]))


def test_requests_that_cannot_fit_are_refused_before_any_step():
    with GraphModel(tiny("qwen3"), backend="cpu", **LIMITS) as gm:
        with pytest.raises(CapacityError, match="exceeds max_model_len=64"):
            gm.generate([[1] * 60], 8)
        assert gm.stats()["captures"] == 0
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(3)
    with pytest.raises(CapacityError, match="2 cache blocks asked for, 1 of 4 free"):
        alloc.allocate(2)
    alloc.release(blocks)
    with pytest.raises(CapacityError, match="double free"):
        alloc.release(blocks[:1])


# -- host reads inside the model's forward ---------------------------------------------


class HostReadMLP(torch.nn.Module):
    """An MLP wrapper that reads device data on the host; its value is the wrapped MLP's."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        limit = float(x.abs().max()) + 1.0  # host read: the line the capture guard names
        return self.inner(x.clamp(-limit, limit))


HOST_READ_LINE = next(
    i for i, line in enumerate(open(__file__), 1) if "the line the capture guard names" in line
)


def _patched_mlp(model: torch.nn.Module) -> tuple[str, object]:
    model.model.layers[0].mlp = HostReadMLP(model.model.layers[0].mlp)
    return rf"test_transformers\.py:{HOST_READ_LINE} ", None


def _mask_path(model: torch.nn.Module) -> tuple[str, object]:
    """A mask function registered for "xgraph": transformers then builds masks, and its
    packed-sequence check reads positions on the host."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("xgraph", sdpa_mask)
    return (
        r"transformers/masking_utils\.py:\d+ ",
        lambda: AttentionMaskInterface._global_mapping.pop("xgraph", None),
    )


@pytest.mark.parametrize("patch", [_patched_mlp, _mask_path], ids=["item", "mask"])
def test_host_reads_are_named_at_capture_and_run_eagerly(patch):
    model = tiny("llama")
    ref = sdpa_copy(model)
    where, undo = patch(model)
    ps = prompts(1, (9, 4))
    try:
        with GraphModel(model, backend="cpu", on_capture_error="raise", **LIMITS) as gm:
            with pytest.raises(
                xgraph.CaptureError,
                match=r"reads device data on the host at "
                rf".*{where}",
            ):
                gm.generate(ps, 4)
            assert gm.stats()["keys"] == []  # rolled back, nothing kept
        with (
            GraphModel(model, backend="cpu", **LIMITS) as gm,
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            result = gm.generate(ps, 4, record_logits=True)
            eager_keys = gm.stats()["eager_keys"]
    finally:
        if undo:
            undo()
    assert_matches_reference(ref, ps, result)
    assert result.graph_steps["eager"] == result.steps > 0
    assert {k[0] for k in eager_keys} == {"full", "piecewise"}
    assert all(re.search(where, cause) for cause in eager_keys.values())
    assert any(issubclass(w.category, xgraph.XGraphWarning) for w in caught)


# -- loading and the command line -------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Llama saved as a local folder (config.json + model.safetensors)."""
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    tiny("llama", seed=3).save_pretrained(folder)
    assert any(f.endswith(".safetensors") for f in os.listdir(folder))
    return folder


def test_xgraph_generate_prints_tokens_and_tokens_per_second(model_folder, capsys):
    args = [
        "generate",
        "--model",
        model_folder,
        "--prompt",
        "1 2 3",
        "--prompt",
        "4 5 6 7 8",
        "--max-new-tokens",
        "5",
        "--backend",
        "cpu",
        "--ignore-eos",
    ]
    assert xgraph_main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"10 tokens for 2 prompt\(s\) in [\d.]+ s on cpu: [\d.]+ tokens/s", out)
    printed = [
        [int(t) for t in re.findall(r"\d+", line.split("] ", 1)[1])]
        for line in out.splitlines()
        if line.startswith("[")
    ]
    # transformers' own greedy generate on the same folder gives the same tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval()
    for prompt, got in zip([[1, 2, 3], [4, 5, 6, 7, 8]], printed):
        with torch.no_grad():
            out_ids = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=5,
                min_new_tokens=5,
                do_sample=False,
                pad_token_id=0,
            )
        assert got == out_ids[0, len(prompt) :].tolist()


def test_xgraph_generate_uses_the_folders_tokenizer(model_folder, tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [f"w{i}" for i in range(TINY["vocab_size"])]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    folder = tmp_path / "with-tokenizer"
    transformers.AutoModelForCausalLM.from_pretrained(model_folder).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(
        folder
    )
    args = [
        "generate",
        "--model",
        str(folder),
        "--prompt",
        "w1 w2 w3",
        "--max-new-tokens",
        "4",
        "--backend",
        "cpu",
        "--ignore-eos",
    ]
    assert xgraph_main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[0]"))
    assert re.fullmatch(r"\[0\] w\d+ w\d+ w\d+ w\d+", line), line


def test_pickled_or_missing_weights_are_refused(tmp_path, capsys, model_folder):
    (tmp_path / "config.json").write_text(open(os.path.join(model_folder, "config.json")).read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    assert xgraph_main(["generate", "--model", str(tmp_path), "--prompt", "1"]) == 2
    err = capsys.readouterr().err
    assert "pickled weights are not loaded" in err and "Traceback" not in err
    with pytest.raises(ModelFolderError, match="not a folder"):
        GraphModel.from_pretrained(str(tmp_path / "nope"), backend="cpu")


def test_the_core_and_the_cli_do_not_import_transformers():
    code = (
        "import sys, xgraph, xgraph.cli, xgraph.integrations.transformers; "
        "xgraph.cli.build_parser(); print('transformers' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_bench_runs_on_cpu_with_a_tiny_config(tmp_path):
    """Every part of the benchmark, in two runs as on a GPU machine, then merged."""
    import json

    from xgraph.integrations.transformers import bench

    common = ["--backend", "cpu", "--model", "tiny", "--iters", "1"]
    gen, comp, merged = tmp_path / "gen.json", tmp_path / "comp.json", tmp_path / "all.json"
    generate = ["--parts", "check,decode,ttft", "--batches", "1,2", "--prompt-len", "8"]
    generate += ["--new-tokens", "4", "--ttft", "1x24,3x8", "--json", str(gen)]
    generate += ["--steps-per-launch", "2"]
    assert bench.main([*common, *generate]) == 0
    compile_ = ["--parts", "compile", "--compiler", "aot_eager", "--capture-sizes", "1,2,4"]
    compile_ += ["--compare", "1,2", "--step-iters", "2", "--json", str(comp)]
    assert bench.main([*common, *compile_]) == 0
    assert bench.main(["--merge", str(gen), str(comp), "--json", str(merged)]) == 0
    data = json.loads(merged.read_text())
    assert data["check"]["passed"] and data["check"]["max_abs_diff"] <= 1e-4
    assert data["check"]["graph_steps"]["piecewise"] > 0  # the long prompt in chunks
    for row in data["decode"]:
        assert row["xgraph"]["decode_tokens_per_second"] > 0
        assert row["transformers"]["decode_tokens_per_second"] > 0
        assert row["xgraph"]["graph_steps"]["eager"] == 0
        k = row["xgraph_k"]  # two steps a launch: the single steps' tokens
        assert k["steps_per_launch"] == 2 and k["tokens_equal"] is True
        assert row["speedup_k"] == pytest.approx(
            k["decode_tokens_per_second"] / row["transformers"]["decode_tokens_per_second"]
        )
        assert "tokens" not in row["xgraph"] and "tokens" not in k
    assert [r["case"] for r in data["ttft"]] == ["1x24", "3x8"]
    assert all(r["xgraph"]["ttft_s"] > 0 and r["transformers"]["ttft_s"] > 0 for r in data["ttft"])
    c = data["compile"]
    for model in ("hf", "reference"):
        one, eager, per = (c[model][v] for v in ("one", "eager", "per_size"))
        assert one["sizes"] == eager["sizes"] == 3
        assert one["compile"]["compiles"] == 2 and one["compile"]["fullgraph"]
        assert per["compile"]["compiles"] == 2 and set(per["first_step_s"]) == {"1", "2"}
        assert set(one["step_s"]) == set(per["step_s"]) == set(eager["step_s"]) == {"1", "2"}
    assert set(c["ratios"]["hf_vs_reference"]) == {"1", "2"}
    assert set(data["seconds"]) == {"compile", "generate"}

"""The measurements of the transformers benchmark: the logits check and two decode loops.

- `check_logits`: a multi-sequence chunked-prefill + decode run through xgraph, every
  step's logits against transformers' own full-sequence forward (sdpa), same weights.
- `xgraph_decode`: decode tokens per second of GraphModel.generate (full-graph decode).
- `transformers_generate_kwargs`: how transformers' generate() runs in every comparison.
- `transformers_decode`: decode tokens per second of transformers' generate() with its
  static cache (and torch.compile, which generate applies to a static cache on a GPU).

Both decode numbers are timed the same way: wall time from the end of the step that
produced a sequence batch's first token to the end of the last step, each step ending with
the host reading the chosen tokens (xgraph: the sampler's `.tolist()`; transformers: a
stopping criterion that synchronises), over the tokens those steps produced.
"""

from __future__ import annotations

import copy
import random
import time
from collections import Counter
from typing import Any

import torch

from .deps import require
from .model import GraphModel

NAMED = {  # config name -> (config class, fields): random weights in the shape of the model
    "tiny": (
        "Qwen3Config",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151_936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40_960,
            tie_word_embeddings=True,
        ),
    ),
    "tiny-llama": (
        "LlamaConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=2048,
        ),
    ),
    # Llama 3.2 1B's shape (its llama3 rope scaling left out: it changes no shape or kernel)
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128_256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=500_000.0,
            max_position_embeddings=131_072,
            tie_word_embeddings=True,
        ),
    ),
}


def model_class(name: str) -> Any:
    """The causal-LM class of a NAMED shape (importing its modeling module)."""
    return getattr(require(), NAMED[name][0].removesuffix("Config") + "ForCausalLM")


def load_folder(folder: str, dtype: torch.dtype, device: torch.device) -> Any:
    """A checkpoint folder's causal LM in `dtype`, in eval mode on `device`."""
    model = require().AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def build_named(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A randomly initialised causal LM of a NAMED shape, in eval mode on `device`."""
    transformers = require()
    cls_name, fields = NAMED[name]
    config = getattr(transformers, cls_name)(**fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)  # wherever from_config built it


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _logits(model: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], device=device)).logits[0]
    return out.float().cpu()


def check_logits(
    gm: GraphModel, reference: Any, prompt_len: int, new_tokens: int = 8
) -> dict[str, Any]:
    """Every logit of every step of an xgraph run against transformers' forward (sdpa): a
    long prompt in chunks (the step budget is half of it), two shorter ones, then decode.

    In 16-bit, rounding differs between any two implementations, so the run is also held
    against a float32 copy of the same weights: xgraph's distance to it
    (`xgraph_vs_float32`) is compared with transformers' own (`transformers_vs_float32`)."""
    lengths = [prompt_len, prompt_len // 2 + 1, min(17, prompt_len)]
    prompts = random_prompts(reference.config.vocab_size, lengths, seed=1)
    chunk = max(16, prompt_len // 2)  # the long prompt is prefilled in chunks
    result = gm.generate(prompts, new_tokens, record_logits=True, max_num_tokens=chunk)
    assert result.logits is not None
    exact = copy.deepcopy(reference).float() if reference.dtype != torch.float32 else None
    m: Counter = Counter()
    for prompt, tokens, got in zip(prompts, result.tokens, result.logits):
        want = _logits(reference, prompt + tokens[:-1], gm.device)
        m["max_abs_diff"] = max(m["max_abs_diff"], float((got - want).abs().max()))
        m["max_abs_logit"] = max(m["max_abs_logit"], float(want.abs().max()))
        m["agree"] += int((got.argmax(-1) == want.argmax(-1)).sum())
        m["rows"] += want.shape[0]
        if exact is not None:
            truth = _logits(exact, prompt + tokens[:-1], gm.device)
            m["xgraph_vs_float32"] = max(m["xgraph_vs_float32"], float((got - truth).abs().max()))
            m["transformers_vs_float32"] = max(
                m["transformers_vs_float32"], float((want - truth).abs().max())
            )
    del exact
    out = {k: float(v) for k, v in m.items() if k not in ("agree", "rows")}
    out.update(
        rel_diff=m["max_abs_diff"] / (m["max_abs_logit"] or 1.0),
        rows=m["rows"],
        argmax_agreement=m["agree"] / m["rows"],
        steps=result.steps,
        graph_steps=result.graph_steps,
    )
    return out


def xgraph_decode(
    gm: GraphModel, batch: int, prompt_len: int, new_tokens: int, iters: int, k: int = 1
) -> dict[str, Any]:
    """Decode tokens/s of GraphModel.generate: wall time from the step that gave the last
    sequence its first token to the end of the last step, each step ending when the host
    has the chosen tokens, over the tokens in between (`GenerationResult.decode_rate`).
    `k` decode steps per launch (the host reads the tokens once a launch); `tokens`: the
    last run's."""
    prompts = random_prompts(gm.spec.vocab_size, [prompt_len] * batch, seed=2)
    gm.generate(prompts, new_tokens, steps_per_launch=k)  # warm-up: captures every graph
    best: dict[str, Any] = {}
    for _ in range(iters):
        r = gm.generate(prompts, new_tokens, steps_per_launch=k)
        rate = r.decode_rate()
        if rate > best.get("decode_tokens_per_second", 0.0):
            lat = r.latency()
            best = {
                "decode_tokens_per_second": rate,
                "decode_steps": r.decode_steps,
                "graph_steps": r.graph_steps,
                "per_token_p50_s": lat["per_token_p50_s"],
                "per_token_p99_s": lat["per_token_p99_s"],
            }
    best["captures"] = gm.stats()["captures"]
    best["tokens"] = r.tokens
    return best


def _step_clock() -> Any:
    """A stopping criterion that synchronises and notes the time after every token."""
    transformers = require()

    class StepClock(transformers.StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


def transformers_generate_kwargs(ids: torch.Tensor, new_tokens: int, compile: bool) -> dict:
    """generate()'s arguments in every comparison: greedy, static cache, compiled or not."""
    return dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
        disable_compile=not compile,
    )


def transformers_decode(
    reference: Any, batch: int, prompt_len: int, new_tokens: int, iters: int, compile: bool
) -> dict[str, Any]:
    """Decode tokens/s of transformers' generate() with a static cache (compiled on a GPU)."""
    transformers = require()
    device = next(reference.parameters()).device
    prompts = random_prompts(reference.config.vocab_size, [prompt_len] * batch, seed=2)
    ids = torch.tensor(prompts, device=device)
    kwargs = transformers_generate_kwargs(ids, new_tokens, compile)
    best = 0.0
    for i in range(iters + 2):  # two warm-ups: compilation, then graph recording
        clock = _step_clock()
        stop = transformers.StoppingCriteriaList([clock])
        with torch.no_grad():
            reference.generate(ids, stopping_criteria=stop, **kwargs)
        if i >= 2 and len(clock.times) > 1:
            seconds = clock.times[-1] - clock.times[0]
            best = max(best, batch * (len(clock.times) - 1) / seconds)
    return {"decode_tokens_per_second": best, "compile": compile}

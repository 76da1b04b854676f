"""`xgraph generate`: run a local transformers model folder through xgraph from the shell.

    xgraph generate --model FOLDER --prompt "1 2 3" --prompt "4 5" --max-new-tokens 32

Prints each sequence's generated token ids (or text, when the folder has a tokenizer; with
--stream as they are chosen), the tokens per second, and the time to first token and
per-token latency, p50 and p99. `--compile` runs the decoder torch.compile'd inside the
graphs (one compile for every bucket; a decoder whose layers run over xgraph's fused kernels
stays uncompiled, GraphModel's default scope), kept for the next process in `--compile-cache
DIR` (default: xgraph.compile_cache's folder; "off": none). This module imports neither
transformers nor torch at import time: the `xgraph` command line builds its parser from it
whether or not the extra is installed.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from ...cli_types import non_negative_float, non_negative_int, positive_int, probability, seed

MODES = ("auto", "full", "piecewise", "eager")
# torch.compile backends that run inside xgraph's graphs (no graphs of their own)
COMPILERS = ("inductor", "aot_eager", "eager")
# where a model folder's loading fails inside the model libraries, not in xgraph
LOADERS = ("transformers", "safetensors", "tokenizers", "huggingface_hub")


def add_parser(sub: Any) -> None:
    """Add the `generate` sub-command to the `xgraph` command line's subparsers."""
    p = sub.add_parser(
        "generate",
        help="generate with a local transformers model folder "
        "through xgraph and print tokens per second",
    )
    p.add_argument(
        "--model",
        required=True,
        help="local model folder: config.json and *.safetensors (no download, no "
        "pickle); a tokenizer there is used when present",
    )
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="a prompt: text when the folder has a tokenizer, else token ids such "
        "as '1 2 3'; repeat the option for several sequences",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=32,
        help="tokens to generate per prompt (default 32)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="backend name (default: XGRAPH_BACKEND, else the best available one)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and cache dtype (auto: float32 on the CPU backend, the "
        "checkpoint's elsewhere)",
    )
    _add_sampling_options(p)
    _add_engine_options(p)
    _add_output_options(p)
    p.set_defaults(func=cmd_generate)


def _add_sampling_options(p: Any) -> None:
    """How the next token is chosen: greedy, or sampled from a seeded generator."""
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 (the default) decodes greedily; above 0 samples",
    )
    p.add_argument(
        "--top-k",
        type=non_negative_int,
        default=0,
        help="sample among the k most likely tokens only (0: all)",
    )
    p.add_argument(
        "--top-p",
        type=probability,
        default=1.0,
        help="sample among the most likely tokens whose probabilities reach p, above 0 and at "
        "most 1 (1: all)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampler (0 to 2**64 - 1)")


def _add_output_options(p: Any) -> None:
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        choices=COMPILERS,
        metavar="BACKEND",
        help="run the decoder torch.compile'd inside the graphs, one compile for every "
        f"bucket (BACKEND: {', '.join(COMPILERS)}; inductor when left out); "
        "XGRAPH_COMPILE_SCOPE=auto leaves a decoder over fused layers uncompiled",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="with --compile: keep the compiled decoder in DIR for the next process on this "
        "machine (default: $XGRAPH_COMPILE_CACHE, else ~/.cache/xgraph/compile; off: none)",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="print each token as it is chosen (`[i] token`), not each sequence at the end",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="show a progress bar of the generated tokens (on by itself past 4096 tokens)",
    )


def _add_engine_options(p: Any) -> None:
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="KV cache block size in tokens"
    )
    p.add_argument(
        "--max-num-tokens",
        type=positive_int,
        default=256,
        help="tokens per step: the prefill chunk size and the largest bucket",
    )
    p.add_argument(
        "--mode",
        default="auto",
        choices=MODES,
        help="executor mode (auto: decode full graphs, prefill piecewise)",
    )
    p.add_argument(
        "--steps-per-launch",
        type=positive_int,
        default=1,
        help="K > 1: decode K steps per launch with sampling and feedback on the device "
        "(docs/multistep.md); the host sees K tokens per sequence at a time",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="always generate --max-new-tokens tokens, even past end-of-sequence",
    )


def _prompts(texts: list[str], tokenizer: Any, folder: str) -> list[list[int]]:
    from ...errors import XGraphError

    if tokenizer is not None:
        return [list(tokenizer.encode(t)) for t in texts]
    try:
        prompts = [[int(x) for x in t.replace(",", " ").split()] for t in texts]
    except ValueError:
        raise XGraphError(
            f"{folder!r} has no tokenizer, so each --prompt must be token ids such as "
            "'1 2 3'; save a tokenizer into the folder to pass text."
        ) from None
    if not all(prompts):
        raise XGraphError("a --prompt is empty; give each prompt at least one token.")
    return prompts


def _raised_in(exc: BaseException, packages: tuple[str, ...]) -> bool:
    """Whether the innermost Python frame of exc's traceback is in one of `packages`."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module.split(".")[0] in packages


@contextlib.contextmanager
def _loading(folder: str) -> Iterator[None]:
    """A folder that transformers (or safetensors) fails to load: ModelFolderError naming
    the folder and the library's own reason in one line, not the library's traceback."""
    from ...errors import XGraphError
    from .errors import ModelFolderError

    try:
        yield
    except XGraphError:
        raise
    except Exception as exc:
        if not _raised_in(exc, LOADERS):
            raise
        lines = str(exc).strip().splitlines()
        reason = lines[0] if lines else ""
        reason = reason[:297] + "..." if len(reason) > 300 else reason.rstrip(".")
        raise ModelFolderError(
            f"transformers could not load {folder!r}: {type(exc).__name__}: {reason}. xgraph "
            "runs decoder-only causal LMs saved with model.save_pretrained(folder) (-v shows "
            "where loading failed)."
        ) from exc


def _eos(model: Any, ignore: bool) -> Any:
    config = getattr(model, "generation_config", None)
    return None if ignore or config is None else config.eos_token_id


def _open_model(args: argparse.Namespace, backend: Any, prompts: list[list[int]]) -> Any:
    """The folder's GraphModel, sized for these prompts and the tokens to generate."""
    from .model import GraphModel

    with _loading(args.model):
        return GraphModel.from_pretrained(
            args.model,
            dtype=args.dtype,
            backend=backend,
            mode=args.mode,
            name="generate",
            block_size=args.block_size,
            max_model_len=max(len(p) for p in prompts) + args.max_new_tokens,
            max_seqs=len(prompts),
            max_num_tokens=args.max_num_tokens,
            compile=args.compile or False,
            compile_cache=args.compile_cache,
        )


def _printer(args: argparse.Namespace, tokenizer: Any) -> Any:
    """--stream: a callback that prints each token as it is chosen; else None."""
    if not args.stream:
        return None

    def show(event: Any) -> None:
        token = tokenizer.decode([event.token]) if tokenizer else event.token
        print(f"[{event.index}] {token}" + (" (end)" if event.finished else ""), flush=True)

    return show


def cmd_generate(args: argparse.Namespace) -> int:
    from ...plugins import get_backend
    from .deps import require
    from .loading import check_folder, load_tokenizer
    from .sampling import SamplingParams

    check_folder(args.model)
    require().utils.logging.disable_progress_bar()  # one line of output per sequence, no bars
    backend = get_backend(args.backend)
    with _loading(args.model):
        tokenizer = load_tokenizer(args.model)
    prompts = _prompts(args.prompt, tokenizer, args.model)
    sampling = SamplingParams(args.temperature, args.top_k, args.seed, args.top_p)
    with _open_model(args, backend, prompts) as gm:
        result = gm.generate(
            prompts,
            args.max_new_tokens,
            eos_token_id=_eos(gm.model, args.ignore_eos),
            sampling=sampling,
            on_token=_printer(args, tokenizer),
            progress=args.progress or len(prompts) * args.max_new_tokens > 4096,
            steps_per_launch=args.steps_per_launch,
        )
    if not args.stream:
        for i, tokens in enumerate(result.tokens):
            shown = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer else tokens
            print(f"[{i}] {shown}")
    g = result.graph_steps
    print(
        f"{result.generated_tokens} tokens for {len(prompts)} prompt(s) in {result.seconds:.3f} s "
        f"on {backend.name}: {result.tokens_per_second:.1f} tokens/s "
        f"(decode steps: {result.decode_tokens_per_second:.1f} tokens/s); steps: "
        f"{g['full']} full-graph, {g['piecewise']} piecewise, {g['eager']} eager"
    )
    lat = result.latency()
    print(
        f"time to first token p50 {lat['ttft_p50_s'] * 1e3:.2f} ms, p99 "
        f"{lat['ttft_p99_s'] * 1e3:.2f} ms; per-token latency p50 "
        f"{lat['per_token_p50_s'] * 1e3:.2f} ms, p99 {lat['per_token_p99_s'] * 1e3:.2f} ms"
    )
    return 0

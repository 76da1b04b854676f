"""Run Hugging Face transformers models through xgraph, unmodified.

    from xgraph.integrations.transformers import GraphModel
    print(GraphModel.from_pretrained("path/to/folder").generate([[1, 2, 3]]).tokens)

transformers lets a program register its own attention function; this package registers
"xgraph", which routes every attention layer to `xgraph.attention` over a paged KV cache
allocated for the model, builds the GraphExecutor from the model's config, and runs a
generation loop on top (continuous batching, chunked prefill, greedy or sampled decode
on the device, streamed tokens).
See docs/transformers.md. transformers is an optional extra (`pip install
xgraph[transformers]`): importing this package does not import it.
"""

from . import bench_startup, bench_target
from .allocator import BlockAllocator
from .attention import IMPLEMENTATION, attention_forward
from .cache import PagedCache
from .engine import Engine, TokenEvent
from .errors import CapacityError, MissingExtraError, ModelFolderError, UnsupportedModelError
from .generate import GenerationResult, generate, stream
from .limits import Limits
from .loading import load_model, load_tokenizer
from .model import GraphModel
from .probe import AttentionCall
from .registration import register
from .sampling import SamplingParams
from .spec import ModelSpec, inspect_model

bench_target.register()  # `xgraph bench memory` offers hf-llama (xgraph.bench's registry)
bench_startup.register()  # `xgraph bench startup` offers hf

__all__ = [
    "IMPLEMENTATION",
    "AttentionCall",
    "BlockAllocator",
    "CapacityError",
    "Engine",
    "GenerationResult",
    "GraphModel",
    "Limits",
    "MissingExtraError",
    "ModelFolderError",
    "ModelSpec",
    "PagedCache",
    "SamplingParams",
    "TokenEvent",
    "UnsupportedModelError",
    "attention_forward",
    "generate",
    "inspect_model",
    "load_model",
    "load_tokenizer",
    "register",
    "stream",
]

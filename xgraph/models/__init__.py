"""Reference workloads: a Qwen3-style decoder with a paged KV cache, and step generators.

Frames of this package are model code: a host read inside these forwards is reported at
its line here, as it would be in an engine's own model.
"""

import os

from ..paging import PagedKVCache
from ..safety import register_model_path
from .qwen3 import Qwen3Config, Qwen3Model
from .workload import TOKEN_INPUTS, Step, Workload

register_model_path(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["TOKEN_INPUTS", "PagedKVCache", "Qwen3Config", "Qwen3Model", "Step", "Workload"]

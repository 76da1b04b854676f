"""Reference workloads: a Qwen3-style decoder with a paged KV cache."""

from .qwen3 import PagedKVCache, Qwen3Config, Qwen3Model

__all__ = ["PagedKVCache", "Qwen3Config", "Qwen3Model"]

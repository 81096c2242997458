"""Paged KV cache: block pool, prefix hashing, replicas, manager and runtime inputs."""

from .manager import PagedKVCacheManager
from .replica import InsufficientBlocksError
from .runtime_inputs import BatchCharacteristics

__all__ = [
    "BatchCharacteristics",
    "InsufficientBlocksError",
    "PagedKVCacheManager",
]

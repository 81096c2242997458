"""Paged KV cache: block pool, prefix hashing, manager and runtime inputs."""

from .manager import InsufficientBlocksError, PagedKVCacheManager
from .runtime_inputs import BatchCharacteristics, PagedCacheInputs

__all__ = [
    "BatchCharacteristics",
    "InsufficientBlocksError",
    "PagedCacheInputs",
    "PagedKVCacheManager",
]

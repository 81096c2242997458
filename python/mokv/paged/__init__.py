"""Paged KV cache: page pool, page table, request state, prefix lookup and
commit, replicas, the manager, and its runtime inputs."""

from .input_plan import BatchCharacteristics
from .manager import PagedKVCacheManager
from .page_pool import InsufficientBlocksError

__all__ = [
    "BatchCharacteristics",
    "InsufficientBlocksError",
    "PagedKVCacheManager",
]

"""mokv: a Mojo- and MAX-graph-native KV cache for LLM inference."""

from .buffer import KVCacheBuffer, KVCacheMemory, ReplicatedKVCacheMemory
from .context import TextContext
from .continuous import ContinuousBatchingKVCacheManager
from .metrics import KVCacheMetrics
from .paged import (
    BatchCharacteristics,
    InsufficientBlocksError,
    PagedCacheInputs,
    PagedKVCacheManager,
)
from .params import KVCacheParams, KVCacheStrategy

__all__ = [
    "BatchCharacteristics",
    "ContinuousBatchingKVCacheManager",
    "InsufficientBlocksError",
    "KVCacheBuffer",
    "KVCacheMemory",
    "KVCacheMetrics",
    "KVCacheParams",
    "KVCacheStrategy",
    "PagedCacheInputs",
    "PagedKVCacheManager",
    "ReplicatedKVCacheMemory",
    "TextContext",
]

"""mokv: a Mojo- and MAX-graph-native KV cache for LLM inference."""

from .buffer import KVCacheBuffer, KVCacheMemory, ReplicatedKVCacheMemory
from .context import CacheContext, TextContext, cache_context
from .continuous import ContinuousBatchingKVCacheManager
from .contract import (
    ContinuousCacheInputs,
    KVCacheInputs,
    MultiKVCacheInputs,
    PagedCacheInputs,
    cache_input_types,
)
from .metrics import KVCacheMetrics
from .paged import BatchCharacteristics, InsufficientBlocksError, PagedKVCacheManager
from .params import KVCacheParams, KVCacheQuantConfig, KVCacheStrategy, MultiKVCacheParams, from_max

__all__ = [
    "BatchCharacteristics",
    "CacheContext",
    "ContinuousBatchingKVCacheManager",
    "ContinuousCacheInputs",
    "InsufficientBlocksError",
    "KVCacheBuffer",
    "KVCacheInputs",
    "KVCacheMemory",
    "KVCacheMetrics",
    "KVCacheParams",
    "KVCacheQuantConfig",
    "KVCacheStrategy",
    "MultiKVCacheInputs",
    "MultiKVCacheParams",
    "PagedCacheInputs",
    "PagedKVCacheManager",
    "ReplicatedKVCacheMemory",
    "TextContext",
    "cache_context",
    "cache_input_types",
    "from_max",
]

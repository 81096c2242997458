"""Graph side of mokv: input types, cache values and op wrappers for model builders."""

from ..contract import cache_input_types, continuous_input_types, paged_input_types
from .cache_values import CacheLayout, ContinuousCacheValues, PagedCacheValues
from .continuous_collection import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    ContinuousBatchingKVCacheCollectionType,
    ContinuousBatchingKVCacheType,
    FetchContinuousBatchingKVCacheCollection,
)
from .graph_group import GraphGroup, new_graph
from .ops import attention, gather_kv, gather_kv_codes, store_kv
from .rotation import hadamard, rotate_heads

__all__ = [
    "CacheLayout",
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "ContinuousBatchingKVCacheCollectionType",
    "ContinuousBatchingKVCacheType",
    "ContinuousCacheValues",
    "FetchContinuousBatchingKVCacheCollection",
    "GraphGroup",
    "PagedCacheValues",
    "attention",
    "cache_input_types",
    "continuous_input_types",
    "gather_kv",
    "gather_kv_codes",
    "hadamard",
    "new_graph",
    "paged_input_types",
    "rotate_heads",
    "store_kv",
]

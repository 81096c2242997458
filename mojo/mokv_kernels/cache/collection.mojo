"""A cache's layers for one batch in either layout (`KVCacheCollection`), under
MAX's names (`PagedKVCacheCollection`, `ContinuousBatchingKVCacheCollection`)."""

from .kv_cache import KVCache
from .layout import CacheGeometry, ContinuousLayout, PageLayout, PagedLayout
from .traits import KVCollectionT


@fieldwise_init
struct KVCacheCollection[dtype: DType, layout_t: PageLayout](KVCollectionT):
    """A cache's layers for one batch, in the pages of `layout_t`."""

    comptime CacheType = KVCache[Self.dtype, Self.layout_t]

    var geometry: CacheGeometry
    var layout: Self.layout_t

    def get_cache(self, layer: Int, kv_idx: Int) -> Self.CacheType:
        return Self.CacheType(self.geometry, self.layout, layer, kv_idx)

    def num_layers(self) -> Int:
        return self.geometry.num_layers


comptime PagedKVCacheCollection[dtype: DType] = KVCacheCollection[dtype, PagedLayout]
"""A paged cache's layers for one batch."""
comptime ContinuousBatchingKVCacheCollection[dtype: DType] = KVCacheCollection[
    dtype, ContinuousLayout
]
"""A continuous-batching cache's layers for one batch."""

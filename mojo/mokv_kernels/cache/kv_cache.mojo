"""One layer's K or V cache in either layout (`KVCache`), under MAX's names
(`PagedKVCache`, `ContinuousBatchingKVCache`)."""

from ..pointers import CachePtr, ScalePtr
from .layout import CacheGeometry, ContinuousLayout, PageLayout, PagedLayout, ScaleTable
from .traits import KVCacheT


@fieldwise_init
struct KVCache[dtype_: DType, layout_t: PageLayout](KVCacheT):
    """A layer's K or V cache in the pages of `layout_t`."""

    comptime dtype = Self.dtype_

    var geometry: CacheGeometry
    var layout: Self.layout_t
    var layer: Int
    var kv_idx: Int

    def batch_size(self) -> Int:
        return self.geometry.batch_size

    def cache_length(self, bs: Int) -> Int:
        return self.geometry.cache_length(bs)

    def num_heads(self) -> Int:
        return self.geometry.n_kv_heads

    def head_dim(self) -> Int:
        return self.geometry.head_dim

    def page_index(self, bs: Int, tok_idx: Int) -> Int:
        return self.layout.page_index(self.geometry, bs, tok_idx)

    def num_pages(self) -> Int:
        return self.geometry.num_pages

    def row_ptr(self, bs: Int, tok_idx: Int) -> CachePtr[Self.dtype_]:
        return self.row_in_page(self.page_index(bs, tok_idx), tok_idx)

    def row_in_page(self, page: Int, tok_idx: Int) -> CachePtr[Self.dtype_]:
        var offset = self.geometry.offset(
            page, self.kv_idx, self.layer, self.layout.token_in_page(self.geometry, tok_idx)
        )
        return self.geometry.pages.unsafe_bitcast[Scalar[Self.dtype_]]().unsafe_offset(offset)

    def scale_row(self, bs: Int, tok_idx: Int) -> ScalePtr:
        return self.scale_row_in_page(self.page_index(bs, tok_idx), tok_idx)

    def scale_row_in_page(self, page: Int, tok_idx: Int) -> ScalePtr:
        var offset = self.geometry.scale_offset(
            page, self.kv_idx, self.layer, self.layout.token_in_page(self.geometry, tok_idx)
        )
        return self.geometry.scales.scales.unsafe_offset(offset)

    def scales(self) -> ScaleTable:
        return self.geometry.scales

    def page_len(self) -> Int:
        return self.geometry.page_len

    def token_in_page(self, tok_idx: Int) -> Int:
        return self.layout.token_in_page(self.geometry, tok_idx)

    def page_stride(self) -> Int:
        return self.geometry.page_elems()

    def contiguous_tokens(self, tok_idx: Int) -> Int:
        return self.layout.contiguous_tokens(self.geometry, tok_idx)

    def max_tokens(self) -> Int:
        return self.layout.max_tokens(self.geometry)


comptime PagedKVCache[dtype: DType] = KVCache[dtype, PagedLayout]
"""A layer's K or V cache stored in pages of `page_size` tokens."""
comptime ContinuousBatchingKVCache[dtype: DType] = KVCache[dtype, ContinuousLayout]
"""A layer's K or V cache with one `max_seq_len` slot per sequence."""

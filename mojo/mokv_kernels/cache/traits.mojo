"""What every kernel is written against: one layer's cache (`KVCacheT`) and
all layers of a cache for one batch (`KVCollectionT`)."""

from ..pointers import CachePtr, ScalePtr
from .layout import ScaleTable


trait KVCacheT(TrivialRegisterPassable):
    """One layer's key or value cache for the sequences of a batch."""

    comptime dtype: DType

    def batch_size(self) -> Int:
        """Rows of the batch (entries of `cache_lengths`)."""
        ...

    def cache_length(self, bs: Int) -> Int:
        """Tokens already cached for batch row `bs`, excluding this step's."""
        ...

    def num_heads(self) -> Int:
        """KV heads per token row."""
        ...

    def head_dim(self) -> Int:
        """Elements per head."""
        ...

    def page_index(self, bs: Int, tok_idx: Int) -> Int:
        """The page (a continuous-batching slot) holding token `tok_idx` of
        row `bs`."""
        ...

    def num_pages(self) -> Int:
        """Pages in the page tensor: every `page_index` must be below it."""
        ...

    def row_ptr(self, bs: Int, tok_idx: Int) -> CachePtr[Self.dtype]:
        """Pointer to the `[n_kv_heads, head_dim]` row of token `tok_idx`."""
        ...

    def row_in_page(self, page: Int, tok_idx: Int) -> CachePtr[Self.dtype]:
        """`row_ptr` of token `tok_idx` once its page (`page_index`) is
        known: a kernel that checks the page first reads the table once."""
        ...

    def page_len(self) -> Int:
        """Token rows of a page (of a continuous-batching slot: the most
        tokens a sequence holds)."""
        ...

    def token_in_page(self, tok_idx: Int) -> Int:
        """The row of its page that holds token `tok_idx`."""
        ...

    def page_stride(self) -> Int:
        """Stored elements from a row of one page to the same row of the
        next page: with `row_in_page(0, 0)` and rows `num_heads() *
        head_dim()` apart, where a copy engine finds every row (a tensor
        map, `..gpu.tensor_map`)."""
        ...

    def contiguous_tokens(self, tok_idx: Int) -> Int:
        """Token rows from `tok_idx` on that lie back to back in memory (to
        the end of its page or slot)."""
        ...

    def max_tokens(self) -> Int:
        """The most tokens one sequence can hold."""
        ...

    def scale_row(self, bs: Int, tok_idx: Int) -> ScalePtr:
        """A quantized cache's `[n_kv_heads, granules]` scales of token
        `tok_idx` (shared by the `tokens_per_scale` tokens of its scale
        block); meaningless for an unquantized cache."""
        ...

    def scale_row_in_page(self, page: Int, tok_idx: Int) -> ScalePtr:
        """`scale_row` of token `tok_idx` once its page is known."""
        ...

    def scales(self) -> ScaleTable:
        """The scale table's shape (empty when unquantized)."""
        ...


trait KVCollectionT(TrivialRegisterPassable):
    """All layers of a cache for one batch; hands out per-layer caches."""

    comptime CacheType: KVCacheT

    def get_cache(self, layer: Int, kv_idx: Int) -> Self.CacheType:
        """Layer `layer`'s key (`kv_idx` 0) or value (1) cache."""
        ...

    def num_layers(self) -> Int:
        ...

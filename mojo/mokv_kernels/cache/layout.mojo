"""Where a cache's tokens and scales live: the page tensor's shape and the
batch's metadata (`CacheGeometry`, with the quantized cache's `ScaleTable`),
and the two ways a batch row's tokens map onto pages (`PageLayout`:
`PagedLayout`, `ContinuousLayout`)."""

from ..pointers import BytePtr, ScalePtr, U32Ptr
from .divisor import Divisor


@fieldwise_init
struct ScaleTable(TrivialRegisterPassable):
    """Where a quantized cache's scales are, and what one covers."""

    var scales: ScalePtr
    var tokens_per_scale: Int
    var rows_per_page: Int
    """Scale rows per page: `page_len // tokens_per_scale`."""
    var granules: Int
    """Scales per head row: each covers `head_dim // granules` elements."""
    var scale_block: Divisor
    """`tokens_per_scale`, to divide a token's place in its page by."""

    @staticmethod
    def of(scales: ScalePtr, page_len: Int, rows_per_page: Int, granules: Int) raises -> Self:
        """The table of `rows_per_page` scale rows per page (a divisor of
        `page_len`), `granules` scales per head row."""
        var tokens_per_scale = page_len // rows_per_page
        return Self(scales, tokens_per_scale, rows_per_page, granules, Divisor.of(tokens_per_scale))

    @staticmethod
    def empty(anywhere: ScalePtr) -> Self:
        """The table of an unquantized cache: no scales, so `anywhere` (a
        pointer is never null) is never read."""
        return Self(anywhere, 1, 0, 0, Divisor.one())


@fieldwise_init
struct CacheGeometry(TrivialRegisterPassable):
    """Shape of the page tensor and the batch's per-row metadata, shared by
    both layouts."""

    var pages: BytePtr
    var num_pages: Int
    var num_layers: Int
    var page_len: Int
    var page_divisor: Divisor
    """`page_len`, to divide a token's position by."""
    var n_kv_heads: Int
    var head_dim: Int
    var batch_size: Int
    var cache_lengths: U32Ptr
    var lookup_table: U32Ptr
    var scales: ScaleTable

    def row_elems(self) -> Int:
        return self.n_kv_heads * self.head_dim

    def page_elems(self) -> Int:
        """Elements of a page: every layer's K and V rows."""
        return 2 * self.num_layers * self.page_len * self.row_elems()

    def offset(self, page: Int, kv_idx: Int, layer: Int, tok_in_page: Int) -> Int:
        """Element offset of one token row inside the page tensor: the
        page's start, the layer's rows in it, the token's row. `page` and
        `tok_in_page` are 32-bit (a page id, a place in a page), so a kernel
        that locates every key multiplies each once, 32 by 64 bits, where
        the nested form took four 64-bit products."""
        var layer_rows = (kv_idx * self.num_layers + layer) * self.page_len
        return Int(
            UInt64(UInt32(page)) * UInt64(self.page_elems())
            + UInt64(layer_rows * self.row_elems())
            + UInt64(UInt32(tok_in_page)) * UInt64(self.row_elems())
        )

    def scale_offset(self, page: Int, kv_idx: Int, layer: Int, tok_in_page: Int) -> Int:
        """Element offset of one token's scales inside the scale table
        (multiplied as `offset` is)."""
        var rows = self.scales.rows_per_page
        var row_scales = self.n_kv_heads * self.scales.granules
        var layer_row = (kv_idx * self.num_layers + layer) * rows
        var row = layer_row + self.scales.scale_block.quotient(tok_in_page)
        return Int(
            UInt64(UInt32(page)) * UInt64(2 * self.num_layers * rows * row_scales)
            + UInt64(row * row_scales)
        )

    def cache_length(self, bs: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=bs])


trait PageLayout(TrivialRegisterPassable):
    """Where a batch row's tokens live in the page tensor. Token indices are
    below 2^31 (a lookup table's columns times its page size, checked where
    a collection is bound), so dividing by a page or scale-block size is a
    `Divisor`'s multiply-high, not a division (a GPU kernel divides every
    key of every tile)."""

    def page_index(self, geometry: CacheGeometry, bs: Int, tok_idx: Int) -> Int:
        """The page (a continuous-batching slot) holding token `tok_idx` of
        row `bs`."""
        ...

    def token_in_page(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        """The token row of that page that holds token `tok_idx`."""
        ...

    def contiguous_tokens(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        """Token rows from `tok_idx` on that lie back to back in memory (to
        the end of its page or slot)."""
        ...

    def max_tokens(self, geometry: CacheGeometry) -> Int:
        """The most tokens one sequence can hold."""
        ...


@fieldwise_init
struct PagedLayout(PageLayout):
    """Pages of `page_len` tokens, `max_pages_per_seq` lookup-table columns
    per row."""

    var max_pages_per_seq: Int

    def page_index(self, geometry: CacheGeometry, bs: Int, tok_idx: Int) -> Int:
        var column = geometry.page_divisor.quotient(tok_idx)
        return Int(geometry.lookup_table[unsafe_offset=bs * self.max_pages_per_seq + column])

    def token_in_page(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return geometry.page_divisor.remainder(tok_idx)

    def contiguous_tokens(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return geometry.page_len - self.token_in_page(geometry, tok_idx)

    def max_tokens(self, geometry: CacheGeometry) -> Int:
        return self.max_pages_per_seq * geometry.page_len


@fieldwise_init
struct ContinuousLayout(PageLayout):
    """One slot per sequence: a page of `page_len` (`max_seq_len`) tokens."""

    def page_index(self, geometry: CacheGeometry, bs: Int, tok_idx: Int) -> Int:
        return Int(geometry.lookup_table[unsafe_offset=bs])

    def token_in_page(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return tok_idx

    def contiguous_tokens(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return geometry.page_len - tok_idx

    def max_tokens(self, geometry: CacheGeometry) -> Int:
        return geometry.page_len

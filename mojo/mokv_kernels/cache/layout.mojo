"""Where a cache's tokens and scales live: the page tensor's shape and the
batch's metadata (`CacheGeometry`, with the quantized cache's `ScaleTable`),
and the two ways a batch row's tokens map onto pages (`PageLayout`:
`PagedLayout`, `ContinuousLayout`)."""

from ..pointers import BytePtr, ScalePtr, U32Ptr


@fieldwise_init
struct ScaleTable(TrivialRegisterPassable):
    """Where a quantized cache's scales are, and what one covers."""

    var scales: ScalePtr
    var tokens_per_scale: Int
    var granules: Int
    """Scales per head row: each covers `head_dim // granules` elements."""

    @staticmethod
    def empty(anywhere: ScalePtr) -> Self:
        """The table of an unquantized cache: no scales, so `anywhere` (a
        pointer is never null) is never read."""
        return Self(anywhere, 1, 0)

    def rows_per_page(self, page_len: Int) -> Int:
        return Int(UInt32(page_len) // UInt32(self.tokens_per_scale))


@fieldwise_init
struct CacheGeometry(TrivialRegisterPassable):
    """Shape of the page tensor and the batch's per-row metadata, shared by
    both layouts."""

    var pages: BytePtr
    var num_pages: Int
    var num_layers: Int
    var page_len: Int
    var n_kv_heads: Int
    var head_dim: Int
    var batch_size: Int
    var cache_lengths: U32Ptr
    var lookup_table: U32Ptr
    var scales: ScaleTable

    def row_elems(self) -> Int:
        return self.n_kv_heads * self.head_dim

    def offset(self, page: Int, kv_idx: Int, layer: Int, tok_in_page: Int) -> Int:
        """Element offset of one token row inside the page tensor."""
        return (
            ((page * 2 + kv_idx) * self.num_layers + layer) * self.page_len + tok_in_page
        ) * self.row_elems()

    def scale_offset(self, page: Int, kv_idx: Int, layer: Int, tok_in_page: Int) -> Int:
        """Element offset of one token's scales inside the scale table."""
        var rows = self.scales.rows_per_page(self.page_len)
        var row = ((page * 2 + kv_idx) * self.num_layers + layer) * rows + Int(
            UInt32(tok_in_page) // UInt32(self.scales.tokens_per_scale)
        )
        return row * self.n_kv_heads * self.scales.granules

    def cache_length(self, bs: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=bs])


trait PageLayout(TrivialRegisterPassable):
    """Where a batch row's tokens live in the page tensor. Token indices and
    page sizes are below 2^32 (a lookup table's columns times its page
    size), so divisions by a page or scale-block size are 32-bit: a 64-bit
    division costs a GPU kernel three times the instructions, every key."""

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
        var column = Int(UInt32(tok_idx) // UInt32(geometry.page_len))
        return Int(geometry.lookup_table[unsafe_offset=bs * self.max_pages_per_seq + column])

    def token_in_page(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return Int(UInt32(tok_idx) % UInt32(geometry.page_len))

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

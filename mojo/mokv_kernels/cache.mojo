"""The KV cache of one layer (key or value side), behind one trait.

Both layouts store tokens as rows of `[n_kv_heads, head_dim]` inside one block
tensor `[num_blocks, 2, num_layers, block_len, n_kv_heads, head_dim]`
(index 0 of dim 1 holds keys, 1 holds values):

- paged (`PagedLayout`): a block is a page of `page_size` tokens; the lookup
  table `[batch, max_pages_per_seq]` maps (row, token // page_size) to a page;
- continuous batching (`ContinuousLayout`): a block is one sequence's slot of
  `max_seq_len` tokens; the lookup table `[batch]` maps a batch row to its slot.

A quantized cache (`float8_e4m3fn` or `int8` blocks, `quant`) keeps float32
scales beside the blocks, `[num_blocks, 2, num_layers, block_len //
tokens_per_scale, n_kv_heads, granules]`: one per granule of
`head_dim // granules` elements of one head of `tokens_per_scale` tokens
(`ScaleTable`). Every cache answers `scale_row`; an unquantized one has none.

Kernels are written against `KVCacheT` only, so both layouts share them. The
layout is a type parameter of one cache struct (`KVCache`) and one collection
struct (`KVCacheCollection`), with MAX's names as aliases (`PagedKVCache`,
`ContinuousBatchingKVCacheCollection`, ...): an op can then choose the layout
at compile time and still hand the kernels a cache whose dtype is its own.
"""

comptime CachePtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]
comptime ScalePtr = Pointer[Float32, MutUntrackedOrigin]


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

    def block_index(self, bs: Int, tok_idx: Int) -> Int:
        """The block (page or slot) holding token `tok_idx` of row `bs`."""
        ...

    def num_blocks(self) -> Int:
        """Blocks in the block tensor: every `block_index` must be below it."""
        ...

    def row_ptr(self, bs: Int, tok_idx: Int) -> CachePtr[Self.dtype]:
        """Pointer to the `[n_kv_heads, head_dim]` row of token `tok_idx`."""
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

    def scales(self) -> ScaleTable:
        """The scale table's shape (empty when unquantized)."""
        ...


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

    def rows_per_block(self, block_len: Int) -> Int:
        return block_len // self.tokens_per_scale


@fieldwise_init
struct CacheGeometry(TrivialRegisterPassable):
    """Shape of the block tensor and the batch's per-row metadata, shared by
    both layouts."""

    var blocks: Pointer[UInt8, MutUntrackedOrigin]
    var num_blocks: Int
    var num_layers: Int
    var block_len: Int
    var n_kv_heads: Int
    var head_dim: Int
    var batch_size: Int
    var cache_lengths: U32Ptr
    var lookup_table: U32Ptr
    var scales: ScaleTable

    def row_elems(self) -> Int:
        return self.n_kv_heads * self.head_dim

    def offset(self, block: Int, kv_idx: Int, layer: Int, tok_in_block: Int) -> Int:
        """Element offset of one token row inside the block tensor."""
        return (
            ((block * 2 + kv_idx) * self.num_layers + layer) * self.block_len + tok_in_block
        ) * self.row_elems()

    def scale_offset(self, block: Int, kv_idx: Int, layer: Int, tok_in_block: Int) -> Int:
        """Element offset of one token's scales inside the scale table."""
        var rows = self.scales.rows_per_block(self.block_len)
        var row = ((block * 2 + kv_idx) * self.num_layers + layer) * rows + (
            tok_in_block // self.scales.tokens_per_scale
        )
        return row * self.n_kv_heads * self.scales.granules

    def cache_length(self, bs: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=bs])


trait BlockLayout(TrivialRegisterPassable):
    """Where a batch row's tokens live in the block tensor."""

    def block_index(self, geometry: CacheGeometry, bs: Int, tok_idx: Int) -> Int:
        """The block (page or slot) holding token `tok_idx` of row `bs`."""
        ...

    def token_in_block(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        """The token row of that block that holds token `tok_idx`."""
        ...

    def contiguous_tokens(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        """Token rows from `tok_idx` on that lie back to back in memory (to
        the end of its page or slot)."""
        ...

    def max_tokens(self, geometry: CacheGeometry) -> Int:
        """The most tokens one sequence can hold."""
        ...


@fieldwise_init
struct PagedLayout(BlockLayout):
    """Pages of `block_len` tokens, `max_pages_per_seq` lookup-table columns
    per row."""

    var max_pages_per_seq: Int

    def block_index(self, geometry: CacheGeometry, bs: Int, tok_idx: Int) -> Int:
        var column = tok_idx // geometry.block_len
        return Int(geometry.lookup_table[unsafe_offset=bs * self.max_pages_per_seq + column])

    def token_in_block(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return tok_idx % geometry.block_len

    def contiguous_tokens(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return geometry.block_len - tok_idx % geometry.block_len

    def max_tokens(self, geometry: CacheGeometry) -> Int:
        return self.max_pages_per_seq * geometry.block_len


@fieldwise_init
struct ContinuousLayout(BlockLayout):
    """One slot of `block_len` (`max_seq_len`) tokens per sequence."""

    def block_index(self, geometry: CacheGeometry, bs: Int, tok_idx: Int) -> Int:
        return Int(geometry.lookup_table[unsafe_offset=bs])

    def token_in_block(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return tok_idx

    def contiguous_tokens(self, geometry: CacheGeometry, tok_idx: Int) -> Int:
        return geometry.block_len - tok_idx

    def max_tokens(self, geometry: CacheGeometry) -> Int:
        return geometry.block_len


@fieldwise_init
struct KVCache[dtype_: DType, layout_t: BlockLayout](KVCacheT):
    """A layer's K or V cache in the blocks of `layout_t`."""

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

    def block_index(self, bs: Int, tok_idx: Int) -> Int:
        return self.layout.block_index(self.geometry, bs, tok_idx)

    def num_blocks(self) -> Int:
        return self.geometry.num_blocks

    def row_ptr(self, bs: Int, tok_idx: Int) -> CachePtr[Self.dtype_]:
        var offset = self.geometry.offset(
            self.block_index(bs, tok_idx),
            self.kv_idx,
            self.layer,
            self.layout.token_in_block(self.geometry, tok_idx),
        )
        return self.geometry.blocks.unsafe_bitcast[Scalar[Self.dtype_]]().unsafe_offset(offset)

    def scale_row(self, bs: Int, tok_idx: Int) -> ScalePtr:
        var offset = self.geometry.scale_offset(
            self.block_index(bs, tok_idx),
            self.kv_idx,
            self.layer,
            self.layout.token_in_block(self.geometry, tok_idx),
        )
        return self.geometry.scales.scales.unsafe_offset(offset)

    def scales(self) -> ScaleTable:
        return self.geometry.scales

    def contiguous_tokens(self, tok_idx: Int) -> Int:
        return self.layout.contiguous_tokens(self.geometry, tok_idx)

    def max_tokens(self) -> Int:
        return self.layout.max_tokens(self.geometry)


comptime PagedKVCache[dtype: DType] = KVCache[dtype, PagedLayout]
"""A layer's K or V cache stored in pages of `page_size` tokens."""
comptime ContinuousBatchingKVCache[dtype: DType] = KVCache[dtype, ContinuousLayout]
"""A layer's K or V cache with one `max_seq_len` slot per sequence."""


trait KVCollectionT(TrivialRegisterPassable):
    """All layers of a cache for one batch; hands out per-layer caches."""

    comptime CacheType: KVCacheT

    def get_cache(self, layer: Int, kv_idx: Int) -> Self.CacheType:
        """Layer `layer`'s key (`kv_idx` 0) or value (1) cache."""
        ...

    def num_layers(self) -> Int:
        ...


@fieldwise_init
struct KVCacheCollection[dtype: DType, layout_t: BlockLayout](KVCollectionT):
    """A cache's layers for one batch, in the blocks of `layout_t`."""

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


@fieldwise_init
struct BatchSummary(TrivialRegisterPassable):
    """What the host states about a batch before any of its rows is read, from
    a cache's fourth graph input: bounds on every row's new tokens, on its
    context including them, and on its cache length. A bound that the input
    does not state is `Int.MAX`.

    Attention checks every row against it before its first write and plans
    its work from it; on a GPU it is what sizes a launch without reading
    device memory."""

    var max_new_tokens: Int
    var max_context: Int
    var max_cache_length: Int

    @staticmethod
    def of_max_lengths(max_new_tokens: Int, max_context: Int) -> Self:
        """A paged cache's `max_lengths` row 0: (most new tokens of a row,
        longest context including them), exact or upper bounds."""
        return Self(max_new_tokens, max_context, Int.MAX)

    @staticmethod
    def of_is_cache_empty(is_cache_empty: Bool) -> Self:
        """A continuous-batching cache's `is_cache_empty`: when true, every
        cache length is 0."""
        return Self(Int.MAX, Int.MAX, 0 if is_cache_empty else Int.MAX)

    def check_row(self, row: Int, cache_length: Int, new_tokens: Int) raises:
        """Raises, naming the input it contradicts, unless batch row `row`
        (`cache_length` cached tokens and `new_tokens` new ones) keeps within
        the bounds."""
        if new_tokens > self.max_new_tokens:
            raise Error(
                t"row {row} has {new_tokens} new tokens but max_lengths[0, 0] is"
                t" {self.max_new_tokens}"
            )
        if cache_length + new_tokens > self.max_context:
            raise Error(
                t"row {row} has {cache_length} cached + {new_tokens} new ="
                t" {cache_length + new_tokens} tokens but max_lengths[0, 1] is {self.max_context}"
            )
        if cache_length > self.max_cache_length:
            raise Error(t"is_cache_empty is true but row {row} has cache_length {cache_length}")


@fieldwise_init
struct OpaqueContinuousCollection(TrivialRegisterPassable):
    """A continuous-batching collection carried through a graph as one opaque
    value. MAX 26.7 cannot put a DType parameter on an opaque graph type, so the
    dtype travels as a field and `typed` checks it against the consumer's."""

    var geometry: CacheGeometry
    var dtype: DType
    var is_cache_empty: Bool

    def typed[dtype: DType](self) raises -> ContinuousBatchingKVCacheCollection[dtype]:
        if self.dtype != dtype:
            raise Error(
                t"the cache collection holds {self.dtype} but the op was given {dtype} tensors"
            )
        return ContinuousBatchingKVCacheCollection[dtype](self.geometry, ContinuousLayout())


@fieldwise_init
struct OpaqueContinuousCache(TrivialRegisterPassable):
    """One layer's keys or values of an opaque continuous-batching collection,
    itself carried through a graph as one opaque value."""

    var collection: OpaqueContinuousCollection
    var layer: Int
    var kv_idx: Int

    def typed[dtype: DType](self) raises -> ContinuousBatchingKVCache[dtype]:
        return self.collection.typed[dtype]().get_cache(self.layer, self.kv_idx)

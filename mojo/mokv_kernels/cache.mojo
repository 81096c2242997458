"""The KV cache of one layer (key or value side), behind one trait.

Both layouts store tokens as rows of `[n_kv_heads, head_dim]` inside one block
tensor `[num_blocks, 2, num_layers, block_len, n_kv_heads, head_dim]`
(index 0 of dim 1 holds keys, 1 holds values):

- paged: a block is a page of `page_size` tokens; the lookup table
  `[batch, max_pages_per_seq]` maps (row, token // page_size) to a page;
- continuous batching: a block is one sequence's slot of `max_seq_len` tokens;
  the lookup table `[batch]` maps a batch row to its slot.

Kernels are written against `KVCacheT` only, so both layouts share them.
"""

comptime CachePtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]


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

    def row_elems(self) -> Int:
        return self.n_kv_heads * self.head_dim

    def offset(self, block: Int, kv_idx: Int, layer: Int, tok_in_block: Int) -> Int:
        """Element offset of one token row inside the block tensor."""
        return (
            ((block * 2 + kv_idx) * self.num_layers + layer) * self.block_len + tok_in_block
        ) * self.row_elems()

    def cache_length(self, bs: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=bs])


@fieldwise_init
struct PagedKVCache[dtype_: DType](KVCacheT):
    """A layer's K or V cache stored in pages of `page_size` tokens."""

    comptime dtype = Self.dtype_

    var geometry: CacheGeometry
    var max_pages_per_seq: Int
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
        var column = tok_idx // self.geometry.block_len
        return Int(self.geometry.lookup_table[unsafe_offset=bs * self.max_pages_per_seq + column])

    def num_blocks(self) -> Int:
        return self.geometry.num_blocks

    def row_ptr(self, bs: Int, tok_idx: Int) -> CachePtr[Self.dtype_]:
        var offset = self.geometry.offset(
            self.block_index(bs, tok_idx),
            self.kv_idx,
            self.layer,
            tok_idx % self.geometry.block_len,
        )
        return self.geometry.blocks.unsafe_bitcast[Scalar[Self.dtype_]]().unsafe_offset(offset)

    def contiguous_tokens(self, tok_idx: Int) -> Int:
        return self.geometry.block_len - tok_idx % self.geometry.block_len

    def max_tokens(self) -> Int:
        return self.max_pages_per_seq * self.geometry.block_len


@fieldwise_init
struct ContinuousBatchingKVCache[dtype_: DType](KVCacheT):
    """A layer's K or V cache with one `max_seq_len` slot per sequence."""

    comptime dtype = Self.dtype_

    var geometry: CacheGeometry
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
        return Int(self.geometry.lookup_table[unsafe_offset=bs])

    def num_blocks(self) -> Int:
        return self.geometry.num_blocks

    def row_ptr(self, bs: Int, tok_idx: Int) -> CachePtr[Self.dtype_]:
        var offset = self.geometry.offset(
            self.block_index(bs, tok_idx), self.kv_idx, self.layer, tok_idx
        )
        return self.geometry.blocks.unsafe_bitcast[Scalar[Self.dtype_]]().unsafe_offset(offset)

    def contiguous_tokens(self, tok_idx: Int) -> Int:
        return self.geometry.block_len - tok_idx

    def max_tokens(self) -> Int:
        return self.geometry.block_len


trait KVCollectionT(TrivialRegisterPassable):
    """All layers of a cache for one batch; hands out per-layer caches."""

    comptime CacheType: KVCacheT

    def get_cache(self, layer: Int, kv_idx: Int) -> Self.CacheType:
        """Layer `layer`'s key (`kv_idx` 0) or value (1) cache."""
        ...

    def num_layers(self) -> Int:
        ...


@fieldwise_init
struct PagedKVCacheCollection[dtype: DType](KVCollectionT):
    """A paged cache's layers for one batch."""

    comptime CacheType = PagedKVCache[Self.dtype]

    var geometry: CacheGeometry
    var max_pages_per_seq: Int

    def get_cache(self, layer: Int, kv_idx: Int) -> Self.CacheType:
        return Self.CacheType(self.geometry, self.max_pages_per_seq, layer, kv_idx)

    def num_layers(self) -> Int:
        return self.geometry.num_layers


@fieldwise_init
struct ContinuousBatchingKVCacheCollection[dtype: DType](KVCollectionT):
    """A continuous-batching cache's layers for one batch."""

    comptime CacheType = ContinuousBatchingKVCache[Self.dtype]

    var geometry: CacheGeometry

    def get_cache(self, layer: Int, kv_idx: Int) -> Self.CacheType:
        return Self.CacheType(self.geometry, layer, kv_idx)

    def num_layers(self) -> Int:
        return self.geometry.num_layers


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
        return ContinuousBatchingKVCacheCollection[dtype](self.geometry)


@fieldwise_init
struct OpaqueContinuousCache(TrivialRegisterPassable):
    """One layer's keys or values of an opaque continuous-batching collection,
    itself carried through a graph as one opaque value."""

    var collection: OpaqueContinuousCollection
    var layer: Int
    var kv_idx: Int

    def typed[dtype: DType](self) raises -> ContinuousBatchingKVCache[dtype]:
        return self.collection.typed[dtype]().get_cache(self.layer, self.kv_idx)

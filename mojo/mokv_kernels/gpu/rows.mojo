"""Store and gather on a GPU: one thread block per token row, its threads
copying the row's `[n_kv_heads, head_dim]` elements in 16-byte vectors.

The tables (`cache_lengths`, `lookup_table`, `input_row_offsets`, the gather
indices) live in device memory, so the host checks only shapes; each block
checks its own row in the kernel and skips it (store) or writes zeros
(gather) when the page or slot is outside the block tensor, the position
past what the lookup-table row addresses, or the batch row out of range: a
bad table entry never becomes an out-of-bounds access, but on a GPU it is not
reported as an error either (the CPU ops report it).
"""

from extensibility import InputTensor, OutputTensor
from std.sys import size_of, bit_width_of

from ..bind import check_layer, check_rows
from ..cache.traits import KVCacheT, KVCollectionT
from ..pointers import CachePtr, F32Ptr, U32Ptr
from .block import BlockExecutor, BlockId, KernelT, Launcher, ThreadProgram

comptime ROW_THREADS = 128


def row_of(row_offsets: U32Ptr, batch: Int, token: Int) -> Int:
    """The batch row whose new tokens include `token`: the last row `b`
    with `row_offsets[b] <= token` (rows without new tokens are skipped)."""
    var lo = 0
    var hi = batch - 1
    while lo < hi:
        var mid = (lo + hi + 1) // 2
        if Int(row_offsets[unsafe_offset=mid]) <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


def row_in_cache[cache_t: KVCacheT](cache: cache_t, bs: Int, tok: Int) -> Bool:
    """Whether token `tok` of batch row `bs` maps to a block of the tensor."""
    return cached_row(cache, bs, tok) != 0


def cached_row[cache_t: KVCacheT](cache: cache_t, bs: Int, tok: Int) -> Int:
    """The address of token `tok`'s row of batch row `bs`, or 0 where it
    maps to no block of the tensor (a bad table entry is never followed);
    the page table read once."""
    return row_in_table_page(cache, table_page(cache, bs, tok), tok)


@always_inline
def table_page[cache_t: KVCacheT](cache: cache_t, bs: Int, tok: Int) -> Int32:
    """What the page table says of token `tok` of batch row `bs`, as read
    (a page, or anything a bad entry holds), or -1 where `bs` or `tok` is
    outside the table. Nothing here uses the value read: a kernel can read
    it a tile ahead and check it (`row_in_table_page`) when it needs it, so
    the read's latency passes while it computes."""
    if bs < 0 or bs >= cache.batch_size() or tok < 0 or tok >= cache.max_tokens():
        return -1
    return Int32(cache.page_index(bs, tok))


@always_inline
def row_in_table_page[cache_t: KVCacheT](cache: cache_t, page: Int32, tok: Int) -> Int:
    """The address of token `tok`'s row in `page` (`table_page`), or 0 where
    that is no page of the tensor."""
    if page < 0 or Int(page) >= cache.num_pages():
        return 0
    return Int(cache.row_in_page(Int(page), tok))


def vector_width[dtype: DType](row_elems: Int, *addresses: Int) -> Int:
    """Elements per 16-byte vector when every row is a whole number of them
    and every given base address is 16-byte aligned, else 1. Block tensors
    are not checked: reading their base address is all the host may do, and
    the trait does not expose it; MAX allocates buffers at least 16-byte
    aligned, and rows start at multiples of the row size."""
    comptime full = 16 // size_of[Scalar[dtype]]()
    if row_elems % full != 0:
        return 1
    for address in addresses:
        if address % 16 != 0:
            return 1
    return full


def _copy_row[
    dtype: DType, width: Int
](dest: CachePtr[dtype], src: CachePtr[dtype], elems: Int, tid: Int):
    comptime align = width * size_of[Scalar[dtype]]()
    for i in range(tid * width, elems, ROW_THREADS * width):
        dest.unsafe_store[alignment=align](i, src.unsafe_load[width=width, alignment=align](i))


struct EachThread[K: RowKernelBody](ThreadProgram):
    """The one-phase program of a row kernel's thread."""

    var kernel: Self.K
    var block: BlockId
    var tid: Int

    def __init__(out self, kernel: Self.K, block: BlockId, tid: Int):
        self.kernel = kernel
        self.block = block
        self.tid = tid

    def step(mut self, phase: Int, arg: Int):
        self.kernel.run(self.block.x, self.tid)


trait RowKernelBody(TrivialRegisterPassable):
    def run(self, row: Int, tid: Int):
        """Thread `tid`'s share of row `row`."""
        ...


@fieldwise_init
struct StoreKernel[cache_t: KVCacheT, width: Int](KernelT, RowKernelBody):
    """Copies new token row `t` of `keys`/`values` to position
    `cache_length[b] + t - row_offsets[b]` of its batch row `b`."""

    comptime Program = EachThread[Self]
    comptime THREADS = ROW_THREADS
    comptime MIN_BLOCKS = 1
    comptime NAME = "store"
    comptime ELEMENT_BITS = bit_width_of[Self.cache_t.dtype]()
    comptime SHARED_BYTES = 0

    var k_cache: Self.cache_t
    var v_cache: Self.cache_t
    var keys: CachePtr[Self.cache_t.dtype]
    var values: CachePtr[Self.cache_t.dtype]
    var row_offsets: U32Ptr
    var num_tokens: Int

    def grid(self) -> BlockId:
        return BlockId(self.num_tokens, 1, 1)

    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return EachThread(self, block, tid)

    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        threads.each(0, 0)

    def run(self, token: Int, tid: Int):
        var batch = self.k_cache.batch_size()
        var bs = row_of(self.row_offsets, batch, token)
        var pos = self.k_cache.cache_length(bs) + token - Int(self.row_offsets[unsafe_offset=bs])
        if not row_in_cache(self.k_cache, bs, pos):
            return
        var elems = self.k_cache.num_heads() * self.k_cache.head_dim()
        var src = token * elems
        _copy_row[width=Self.width](
            self.k_cache.row_ptr(bs, pos), self.keys.unsafe_offset(src), elems, tid
        )
        _copy_row[width=Self.width](
            self.v_cache.row_ptr(bs, pos), self.values.unsafe_offset(src), elems, tid
        )


@fieldwise_init
struct GatherKernel[cache_t: KVCacheT, width: Int](KernelT, RowKernelBody):
    """Copies token `positions[i]` of batch row `batch_rows[i]` to row `i` of
    `dest`, or zeros when that token is not in the cache."""

    comptime Program = EachThread[Self]
    comptime THREADS = ROW_THREADS
    comptime MIN_BLOCKS = 1
    comptime NAME = "gather"
    comptime ELEMENT_BITS = bit_width_of[Self.cache_t.dtype]()
    comptime SHARED_BYTES = 0

    var cache: Self.cache_t
    var dest: CachePtr[Self.cache_t.dtype]
    var batch_rows: U32Ptr
    var positions: U32Ptr
    var num_rows: Int

    def grid(self) -> BlockId:
        return BlockId(self.num_rows, 1, 1)

    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return EachThread(self, block, tid)

    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        threads.each(0, 0)

    def run(self, i: Int, tid: Int):
        var bs = Int(self.batch_rows[unsafe_offset=i])
        var pos = Int(self.positions[unsafe_offset=i])
        var elems = self.cache.num_heads() * self.cache.head_dim()
        var dest = self.dest.unsafe_offset(i * elems)
        if row_in_cache(self.cache, bs, pos):
            _copy_row[width=Self.width](dest, self.cache.row_ptr(bs, pos), elems, tid)
        else:
            for e in range(tid, elems, ROW_THREADS):
                dest[unsafe_offset=e] = 0


def _address[T: AnyType](p: Pointer[T, MutUntrackedOrigin]) -> Int:
    return Int(p)


def _untracked[dtype: DType](t: InputTensor[dtype=dtype, ...]) -> CachePtr[dtype]:
    return t.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def store_kv_gpu[
    collection_t: KVCollectionT, L: Launcher, src_dtype: DType
](
    mut launcher: L,
    collection: collection_t,
    layer_idx: UInt32,
    keys: InputTensor[dtype=src_dtype, rank=3, ...],
    values: InputTensor[dtype=src_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.store_kv` on a GPU: checks the shapes on the host, then one
    block per new token copies its keys and values into the cache."""
    comptime dtype = collection_t.CacheType.dtype
    comptime assert src_dtype == dtype, "the GPU path stores unquantized caches only"
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    var k_cache = collection.get_cache(layer, 0)
    var v_cache = collection.get_cache(layer, 1)
    check_rows(k_cache, keys, "keys")
    check_rows(v_cache, values, "values")
    var tokens = keys.dim_size(0)
    if values.dim_size(0) != tokens:
        raise Error(t"values have {values.dim_size(0)} tokens but keys have {tokens}")
    var batch = k_cache.batch_size()
    if row_offsets.dim_size(0) != batch + 1:
        raise Error(
            t"input_row_offsets has {row_offsets.dim_size(0)} entries but the"
            t" cache describes {batch} rows (expected {batch + 1})"
        )
    if tokens == 0 or batch == 0:
        return
    var k_src = rebind[CachePtr[dtype]](_untracked(keys))
    var v_src = rebind[CachePtr[dtype]](_untracked(values))
    var offsets = row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var elems = k_cache.num_heads() * k_cache.head_dim()
    var width = vector_width[dtype](elems, _address(k_src), _address(v_src))
    comptime full = 16 // size_of[Scalar[dtype]]()
    if width == full:
        launcher.launch(
            StoreKernel[collection_t.CacheType, full](
                k_cache, v_cache, k_src, v_src, offsets, tokens
            )
        )
    else:
        launcher.launch(
            StoreKernel[collection_t.CacheType, 1](k_cache, v_cache, k_src, v_src, offsets, tokens)
        )


def gather_rows_gpu[
    cache_t: KVCacheT, L: Launcher, dest_dtype: DType
](
    mut launcher: L,
    cache: cache_t,
    dest: OutputTensor[dtype=dest_dtype, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Token `positions[i]` of batch row `batch_rows[i]` into `dest[i]`, one
    block per requested row."""
    var n = dest.dim_size(0)
    if dest.dim_size(1) != cache.num_heads() or dest.dim_size(2) != cache.head_dim():
        raise Error(
            t"the output has shape [*, {dest.dim_size(1)}, {dest.dim_size(2)}] but"
            t" the cache rows are [*, {cache.num_heads()}, {cache.head_dim()}]"
        )
    if batch_rows.dim_size(0) != n or positions.dim_size(0) != n:
        raise Error(
            t"batch_rows has {batch_rows.dim_size(0)} entries and positions"
            t" {positions.dim_size(0)}, but {n} rows are gathered"
        )
    if n == 0:
        return
    comptime assert dest_dtype == cache_t.dtype, "the GPU path gathers unquantized caches only"
    var dst = rebind[CachePtr[cache_t.dtype]](
        dest.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    )
    var rows = batch_rows.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var pos = positions.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    comptime full = 16 // size_of[Scalar[cache_t.dtype]]()
    if vector_width[cache_t.dtype](cache.num_heads() * cache.head_dim(), _address(dst)) == full:
        launcher.launch(GatherKernel[cache_t, full](cache, dst, rows, pos, n))
    else:
        launcher.launch(GatherKernel[cache_t, 1](cache, dst, rows, pos, n))

"""Store and gather of a quantized cache on a GPU: the storage of `..kv_quantization`
(`float8_e4m3fn` or `int8` codes, float32 scales per granule of one head of
`tokens_per_scale` tokens), the same codes and scales as the CPU ops write.

Everything a kernel calls is inlined, as `block.GpuBlock` requires.

Store: one block per new token; the block of the first new token of each
scale block quantizes all of that scale block's new tokens in one pass: the
granule's scale is its largest finite magnitude over the new tokens, over
the largest code. A scale block that starts with the new tokens (every
token of a prefill, and every token with one scale per token, the default)
takes `GRANULE_LANES` neighbouring lanes a granule, each finding the
largest magnitude of its chunks and quantizing them, the lanes combining
their maxima by shuffles; one thread a granule took it whole before, a
sixteenth of a block's threads busy at head_dim 128, and the tenth GPU run
timed it at 2.8-4.9x a float32 copy's time. Where tokens already in the
scale block (a decode step into it) held a smaller scale, one thread a
granule requantizes them under the new one first, so every code of a scale
block means code * its one scale.
Gather: one block per requested row, its codes widened and scaled into the
output's dtype (`mokv.gather.quantized`), or copied as stored with their
scales (`mokv.gather.codes`). As for unquantized rows (`rows`), a block
skips (store) or zeroes (gather) a row whose page, slot or position is
outside the cache."""

from extensibility import InputTensor, OutputTensor
from std.memory import bitcast
from std.sys import size_of

from ..bind import check_layer, check_rows
from ..cache.traits import KVCacheT, KVCollectionT
from ..pointers import CachePtr, F32Ptr, ScalePtr, U32Ptr
from ..kv_quantization import code_max, encode, is_quantized, widen, widened_unit
from .block import BlockExecutor, BlockId, KernelT, Launcher
from .codes import as_values
from .rows import ROW_THREADS, EachThread, RowKernelBody, row_in_cache, row_of
from .warp import WARP, shuffle_xor

comptime W = 8
"""Elements a thread quantizes at once, in aligned vectors: the store takes
granules of a multiple of `W` elements."""
comptime GRANULE_LANES = 16
"""Neighbouring lanes that quantize one granule of a fresh scale block
(`quantize_fresh_block`): a head row of 128 elements is a chunk of `W` a
lane; they combine maxima with shuffles within their half of a warp."""
comptime GRANULE_STEPS = 4
"""Shuffles that combine `GRANULE_LANES` maxima (its base-2 log)."""


@always_inline
def _saturated_codes[dtype: DType](values: SIMD[DType.float32, W], inv: Float32) -> SIMD[dtype, W]:
    """Codes of `values * inv`: saturated at the code range, NaN as 0 (the
    CPU store's rule)."""
    comptime limit = code_max[dtype]()
    var x = values * inv
    var clamped = min(max(x, SIMD[DType.float32, W](-limit)), SIMD[DType.float32, W](limit))
    return encode[dtype, W](x.eq(x).select(clamped, SIMD[DType.float32, W](0)))


@always_inline
def _largest_finite[src_dtype: DType](src: CachePtr[src_dtype], count: Int) -> Float32:
    var lanes = SIMD[DType.float32, W](0)
    for i in range(0, count, W):
        var x = abs(
            src.unsafe_load[width=W, alignment=W * size_of[Scalar[src_dtype]]()](i).cast[
                DType.float32
            ]()
        )
        lanes = (x.lt(SIMD[DType.float32, W](Float32.MAX_FINITE)) & x.gt(lanes)).select(x, lanes)
    return lanes.reduce_max()


@always_inline
def _quantize_granule[
    dtype: DType, src_dtype: DType
](src: CachePtr[src_dtype], count: Int, scale: Float32, dst: CachePtr[dtype]):
    comptime src_align = W * size_of[Scalar[src_dtype]]()
    var inv = 1 / scale if scale > 0 else Float32(0)
    for i in range(0, count, W):
        var values = src.unsafe_load[width=W, alignment=src_align](i).cast[DType.float32]()
        dst.unsafe_store[alignment=W](i, _saturated_codes[dtype](values, inv))


@always_inline
def _requantize_granule[
    dtype: DType
](codes: CachePtr[dtype], count: Int, old: Float32, new: Float32):
    var inv = 1 / new if new > 0 else Float32(0)
    var unit = old * widened_unit[dtype]()
    for i in range(0, count, W):
        var values = widen[dtype, W](codes.unsafe_load[width=W, alignment=W](i)) * unit
        codes.unsafe_store[alignment=W](i, _saturated_codes[dtype](values, inv))


@always_inline
def _granule_start(granule: Int, granules: Int, d: Int) -> Int:
    """Where granule `granule` of a token's heads (`granules` a head row of
    `d`) starts in the token's row."""
    return granule // granules * d + granule % granules * (d // granules)


@always_inline
def quantize_scale_block[
    cache_t: KVCacheT, src_dtype: DType
](cache: cache_t, bs: Int, first_new: Int, end: Int, src: CachePtr[src_dtype], tid: Int,):
    """Thread `tid`'s granules of the new tokens `first_new ..< end` of batch
    row `bs` (one scale block's; `src` holds their rows): scale, codes, and
    the tokens the block held before requantized if the scale grew."""
    comptime dtype = cache_t.dtype
    var table = cache.scales()
    var d = cache.head_dim()
    var row = cache.num_heads() * d
    var granularity = d // table.granules
    var block_start = first_new - first_new % table.tokens_per_scale
    var scales = cache.scale_row(bs, block_start)
    for granule in range(tid, cache.num_heads() * table.granules, ROW_THREADS):
        var at = _granule_start(granule, table.granules, d)
        var largest: Float32 = 0
        for t in range(end - first_new):
            largest = max(largest, _largest_finite(src.unsafe_offset(t * row + at), granularity))
        var scale = largest / code_max[dtype]()
        if first_new > block_start:
            var old = scales[unsafe_offset=granule]
            if scale > old:
                for t in range(block_start, first_new):
                    _requantize_granule(
                        cache.row_ptr(bs, t).unsafe_offset(at), granularity, old, scale
                    )
            else:
                scale = old
        scales[unsafe_offset=granule] = scale
        for t in range(first_new, end):
            _quantize_granule(
                src.unsafe_offset((t - first_new) * row + at),
                granularity,
                scale,
                cache.row_ptr(bs, t).unsafe_offset(at),
            )


@always_inline
def quantize_fresh_block[
    cache_t: KVCacheT, src_dtype: DType, lanes: Int
](cache: cache_t, bs: Int, first_new: Int, end: Int, src: CachePtr[src_dtype], tid: Int):
    """The new tokens `first_new ..< end` of batch row `bs`, the first of a
    scale block and all of its tokens so far (`src` holds their rows):
    `GRANULE_LANES` neighbouring lanes of the program at thread `tid` (one
    thread, or under the emulator a warp of `lanes`) take a granule, each
    its chunks `lane, lane + GRANULE_LANES, ..` of `W` elements. Every
    thread of the block runs the same passes (the shuffles take whole
    warps); lanes past the last granule carry a zero."""
    comptime assert (
        GRANULE_LANES == 1 << GRANULE_STEPS
        and WARP % GRANULE_LANES == 0
        and ROW_THREADS % WARP == 0
    ), "lane layout"
    comptime dtype = cache_t.dtype
    var table = cache.scales()
    var d = cache.head_dim()
    var row = cache.num_heads() * d
    var granularity = d // table.granules
    var chunks = granularity // W
    var slots = cache.num_heads() * table.granules * GRANULE_LANES
    var scales = cache.scale_row(bs, first_new)
    for base in range(0, slots, ROW_THREADS):
        var largest = Array[Float32, lanes](fill=0)
        for l in range(lanes):
            var slot = base + tid + l
            if slot < slots:
                var granule = slot // GRANULE_LANES
                var at = _granule_start(granule, table.granules, d)
                var most: Float32 = 0
                for t in range(end - first_new):
                    for c in range(slot % GRANULE_LANES, chunks, GRANULE_LANES):
                        most = max(
                            most, _largest_finite(src.unsafe_offset(t * row + at + c * W), W)
                        )
                largest[l] = most
        comptime for step in range(GRANULE_STEPS):
            var other = shuffle_xor[lanes](largest, GRANULE_LANES >> (step + 1))
            for l in range(lanes):
                largest[l] = max(largest[l], other[l])
        for l in range(lanes):
            var slot = base + tid + l
            if slot < slots:
                var granule = slot // GRANULE_LANES
                var at = _granule_start(granule, table.granules, d)
                var scale = largest[l] / code_max[dtype]()
                if slot % GRANULE_LANES == 0:
                    scales[unsafe_offset=granule] = scale
                for t in range(first_new, end):
                    for c in range(slot % GRANULE_LANES, chunks, GRANULE_LANES):
                        _quantize_granule(
                            src.unsafe_offset((t - first_new) * row + at + c * W),
                            W,
                            scale,
                            cache.row_ptr(bs, t).unsafe_offset(at + c * W),
                        )


@fieldwise_init
struct StoreQuantizedKernel[cache_t: KVCacheT, src_dtype: DType, lanes: Int](
    KernelT, RowKernelBody
):
    """Quantizes new token rows into their positions (see the module
    docstring): grid one block per new token."""

    comptime Program = EachThread[Self]
    comptime THREADS = ROW_THREADS
    comptime LANES = Self.lanes
    comptime MIN_BLOCKS = 1
    comptime NAME = "store_quantized"
    comptime ELEMENT_BITS = 8
    comptime SHARED_BYTES = 0

    var k_cache: Self.cache_t
    var v_cache: Self.cache_t
    var keys: CachePtr[Self.src_dtype]
    var values: CachePtr[Self.src_dtype]
    var row_offsets: U32Ptr
    var num_tokens: Int

    def grid(self) -> BlockId:
        return BlockId(self.num_tokens, 1, 1)

    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return EachThread(self, block, tid)

    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        threads.each(0, 0)

    def run(self, token: Int, tid: Int):
        var bs = row_of(self.row_offsets, self.k_cache.batch_size(), token)
        var start = Int(self.row_offsets[unsafe_offset=bs])
        var first = self.k_cache.cache_length(bs)
        var pos = first + token - start
        var per = self.k_cache.scales().tokens_per_scale
        var block_start = pos - pos % per
        if pos != max(block_start, first) or not row_in_cache(self.k_cache, bs, pos):
            return
        var end = min(
            block_start + per, first + Int(self.row_offsets[unsafe_offset=bs + 1]) - start
        )
        var row = self.k_cache.num_heads() * self.k_cache.head_dim()
        var keys = self.keys.unsafe_offset(token * row)
        var values = self.values.unsafe_offset(token * row)
        if pos == block_start:
            quantize_fresh_block[lanes=Self.lanes](self.k_cache, bs, pos, end, keys, tid)
            quantize_fresh_block[lanes=Self.lanes](self.v_cache, bs, pos, end, values, tid)
            return
        for l in range(Self.lanes):
            quantize_scale_block(self.k_cache, bs, pos, end, keys, tid + l)
            quantize_scale_block(self.v_cache, bs, pos, end, values, tid + l)


@fieldwise_init
struct GatherQuantizedKernel[cache_t: KVCacheT, dest_dtype: DType, codes: Bool](
    KernelT, RowKernelBody
):
    """Row `i` of the output: token `positions[i]` of batch row
    `batch_rows[i]`, dequantized into `dest_dtype`, or (`codes`) its codes
    as stored and their scales; zeros for a token not in the cache."""

    comptime Program = EachThread[Self]
    comptime THREADS = ROW_THREADS
    comptime MIN_BLOCKS = 1
    comptime NAME = "gather_codes" if Self.codes else "gather_quantized"
    comptime ELEMENT_BITS = 8
    comptime SHARED_BYTES = 0

    var cache: Self.cache_t
    var dest: CachePtr[Self.dest_dtype]
    var dest_scales: ScalePtr
    """`codes`: the scales' output `[n, n_kv_heads, granules]`."""
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
        comptime dtype = Self.cache_t.dtype
        var bs = Int(self.batch_rows[unsafe_offset=i])
        var pos = Int(self.positions[unsafe_offset=i])
        var granules = self.cache.scales().granules
        var elems = self.cache.num_heads() * self.cache.head_dim()
        var granularity = self.cache.head_dim() // granules
        var found = row_in_cache(self.cache, bs, pos)
        var dest = self.dest.unsafe_offset(i * elems)
        comptime if Self.codes:
            var scales = self.dest_scales.unsafe_offset(i * self.cache.num_heads() * granules)
            for g in range(tid, self.cache.num_heads() * granules, ROW_THREADS):
                scales[unsafe_offset=g] = self.cache.scale_row(bs, pos)[
                    unsafe_offset=g
                ] if found else 0
        for e in range(tid, elems, ROW_THREADS):
            var code = Scalar[dtype](0)
            var scale: Float32 = 0
            if found:
                code = self.cache.row_ptr(bs, pos)[unsafe_offset=e]
                scale = self.cache.scale_row(bs, pos)[unsafe_offset=e // granularity]
            comptime if Self.codes:
                dest[unsafe_offset=e] = bitcast[Self.dest_dtype, 1](code)
            else:
                dest[unsafe_offset=e] = as_values[dtype, 1](code, scale).cast[Self.dest_dtype]()


def _ptr[dtype: DType](t: InputTensor[dtype=dtype, ...]) -> CachePtr[dtype]:
    return t.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def store_kv_quantized_gpu[
    collection_t: KVCollectionT, L: Launcher, src_dtype: DType
](
    mut launcher: L,
    collection: collection_t,
    layer_idx: UInt32,
    keys: InputTensor[dtype=src_dtype, rank=3, ...],
    values: InputTensor[dtype=src_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.store_kv.quantized` on a GPU: checks the shapes on the host,
    then quantizes the new rows (see the module docstring)."""
    comptime assert is_quantized[collection_t.CacheType.dtype](), "a quantized cache"
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    var k_cache = collection.get_cache(layer, 0)
    check_rows(k_cache, keys, "keys")
    check_rows(k_cache, values, "values")
    var tokens = keys.dim_size(0)
    if values.dim_size(0) != tokens:
        raise Error(t"values have {values.dim_size(0)} tokens but keys have {tokens}")
    var granularity = k_cache.head_dim() // k_cache.scales().granules
    if granularity % W != 0:
        raise Error(t"granules of {granularity} elements: the GPU store takes multiples of {W}")
    var batch = k_cache.batch_size()
    if row_offsets.dim_size(0) != batch + 1:
        raise Error(
            t"input_row_offsets has {row_offsets.dim_size(0)} entries but the"
            t" cache describes {batch} rows (expected {batch + 1})"
        )
    if tokens == 0 or batch == 0:
        return
    launcher.launch(
        StoreQuantizedKernel[collection_t.CacheType, src_dtype, L.LANES](
            k_cache,
            collection.get_cache(layer, 1),
            _ptr(keys),
            _ptr(values),
            _ptr(row_offsets),
            tokens,
        )
    )


def gather_quantized_gpu[
    cache_t: KVCacheT, L: Launcher, dest_dtype: DType
](
    mut launcher: L,
    cache: cache_t,
    dest: OutputTensor[dtype=dest_dtype, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.gather.quantized` on a GPU: one block per requested row."""
    _gather[codes=False](launcher, cache, dest, cache.scales().scales, batch_rows, positions)


def gather_codes_gpu[
    cache_t: KVCacheT, L: Launcher, codes_dtype: DType
](
    mut launcher: L,
    cache: cache_t,
    codes: OutputTensor[dtype=codes_dtype, rank=3, ...],
    scales: OutputTensor[dtype=DType.float32, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.gather.codes` on a GPU: the rows' codes as stored and their
    scales `[n, n_kv_heads, granules]`."""
    var granules = cache.scales().granules
    if (
        scales.dim_size(0) != codes.dim_size(0)
        or scales.dim_size(1) != cache.num_heads()
        or scales.dim_size(2) != granules
    ):
        raise Error(
            t"the scales output is [{scales.dim_size(0)}, {scales.dim_size(1)},"
            t" {scales.dim_size(2)}] but {codes.dim_size(0)} rows of"
            t" [{cache.num_heads()}, {granules}] scales are gathered"
        )
    _gather[codes=True](
        launcher,
        cache,
        codes,
        scales.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        batch_rows,
        positions,
    )


def _gather[
    cache_t: KVCacheT, L: Launcher, dest_dtype: DType, //, codes: Bool
](
    mut launcher: L,
    cache: cache_t,
    dest: OutputTensor[dtype=dest_dtype, rank=3, ...],
    dest_scales: ScalePtr,
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
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
    launcher.launch(
        GatherQuantizedKernel[cache_t, dest_dtype, codes](
            cache,
            dest.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            dest_scales,
            _ptr(batch_rows),
            _ptr(positions),
            n,
        )
    )

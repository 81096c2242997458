"""Writing a ragged batch's new keys/values into the cache, and reading token
rows back out (for tests, host offload and the inspector)."""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from std.memory import unsafe_memcpy

from .bind import (
    bind_collection,
    bind_scales,
    check_layer,
    check_row_offsets,
    check_rows,
    check_token_range,
    layer_cache,
)
from .cache.traits import KVCacheT, KVCollectionT
from .pointers import CachePtr
from .kv_quantization import codes_in, is_quantized, load_dequantized, store_quantized
from .gpu.block import GpuLauncher
from .gpu.quantized import gather_codes_gpu, gather_quantized_gpu, store_kv_quantized_gpu
from .gpu.rows import gather_rows_gpu, store_kv_gpu


def store_rows[
    cache_t: KVCacheT, src_dtype: DType
](
    k_cache: cache_t,
    v_cache: cache_t,
    keys: InputTensor[dtype=src_dtype, rank=3, ...],
    values: InputTensor[dtype=src_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Writes each row's new keys and values to positions `cache_length ..
    cache_length + n` of its sequence in one pass over the new tokens: for
    each contiguous run (to the end of a page or slot), the keys and then
    the values, copied, or quantized with their scales (`store_quantized`)
    into a quantized cache. Every check runs before the first write."""
    check_rows(k_cache, keys, "keys")
    check_rows(v_cache, values, "values")
    var batch = k_cache.batch_size()
    check_row_offsets(row_offsets, batch, keys.dim_size(0))
    if values.dim_size(0) != keys.dim_size(0):
        raise Error(t"values have {values.dim_size(0)} tokens but keys have {keys.dim_size(0)}")
    var offsets = row_offsets.unsafe_ptr()
    for bs in range(batch):
        var start = Int(offsets[unsafe_offset=bs])
        var end = Int(offsets[unsafe_offset=bs + 1])
        var tok = k_cache.cache_length(bs)
        check_token_range(k_cache, bs, tok, tok + end - start)

    var row = k_cache.num_heads() * k_cache.head_dim()
    var k_src = keys.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var v_src = values.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for bs in range(batch):
        var start = Int(offsets[unsafe_offset=bs])
        var n = Int(offsets[unsafe_offset=bs + 1]) - start
        var tok = k_cache.cache_length(bs)
        var done = 0
        while done < n:
            var run = min(n - done, k_cache.contiguous_tokens(tok + done))
            var src_offset = (start + done) * row
            comptime if is_quantized[cache_t.dtype]():
                store_quantized(k_cache, bs, tok + done, run, k_src.unsafe_offset(src_offset))
                store_quantized(v_cache, bs, tok + done, run, v_src.unsafe_offset(src_offset))
            else:
                comptime assert (
                    src_dtype == cache_t.dtype
                ), "keys and values of an unquantized cache have its dtype"
                unsafe_memcpy(
                    dest=k_cache.row_ptr(bs, tok + done),
                    src=rebind[CachePtr[cache_t.dtype]](k_src.unsafe_offset(src_offset)),
                    count=run * row,
                )
                unsafe_memcpy(
                    dest=v_cache.row_ptr(bs, tok + done),
                    src=rebind[CachePtr[cache_t.dtype]](v_src.unsafe_offset(src_offset)),
                    count=run * row,
                )
            done += run


def gather_rows[
    cache_t: KVCacheT, dest_dtype: DType
](
    cache: cache_t,
    dest: OutputTensor[dtype=dest_dtype, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Writes token row `positions[i]` of batch row `batch_rows[i]` to
    `dest[i]`, for every i: copied, or dequantized from a quantized cache."""
    var row = cache.num_heads() * cache.head_dim()
    var n = dest.dim_size(0)
    var rows = batch_rows.unsafe_ptr()
    var pos = positions.unsafe_ptr()
    for i in range(n):
        var bs = Int(rows[unsafe_offset=i])
        var tok = Int(pos[unsafe_offset=i])
        check_token_range(cache, bs, tok, tok + 1)
    var dst = dest.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for i in range(n):
        var bs = Int(rows[unsafe_offset=i])
        var tok = Int(pos[unsafe_offset=i])
        comptime if is_quantized[cache_t.dtype]():
            load_dequantized(cache, bs, tok, dst.unsafe_offset(i * row))
        else:
            comptime assert (
                dest_dtype == cache_t.dtype
            ), "rows of an unquantized cache have its dtype"
            unsafe_memcpy(
                dest=rebind[CachePtr[cache_t.dtype]](dst.unsafe_offset(i * row)),
                src=cache.row_ptr(bs, tok),
                count=row,
            )


def gather_codes[
    cache_t: KVCacheT, codes_dtype: DType
](
    cache: cache_t,
    codes: OutputTensor[dtype=codes_dtype, rank=3, ...],
    scales: OutputTensor[dtype=DType.float32, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """A quantized cache's token rows as stored: codes `[n, n_kv_heads,
    head_dim]` (as the `blocks` tensor's graph dtype holds them) and their scales
    `[n, n_kv_heads, granules]`."""
    var table = cache.scales()
    var row = cache.num_heads() * cache.head_dim()
    var scale_row = cache.num_heads() * table.granules
    if scales.dim_size(1) != cache.num_heads() or scales.dim_size(2) != table.granules:
        raise Error(
            t"the scales output is [*, {scales.dim_size(1)}, {scales.dim_size(2)}] but the"
            t" cache's scale rows are [*, {cache.num_heads()}, {table.granules}]"
        )
    var n = codes.dim_size(0)
    var rows = batch_rows.unsafe_ptr()
    var pos = positions.unsafe_ptr()
    for i in range(n):
        var bs = Int(rows[unsafe_offset=i])
        var tok = Int(pos[unsafe_offset=i])
        check_token_range(cache, bs, tok, tok + 1)
    for i in range(n):
        var bs = Int(rows[unsafe_offset=i])
        var tok = Int(pos[unsafe_offset=i])
        unsafe_memcpy(
            dest=codes.unsafe_ptr()
            .unsafe_origin_cast[MutUntrackedOrigin]()
            .unsafe_bitcast[Scalar[cache_t.dtype]]()
            .unsafe_offset(i * row),
            src=cache.row_ptr(bs, tok),
            count=row,
        )
        unsafe_memcpy(
            dest=scales.unsafe_ptr()
            .unsafe_origin_cast[MutUntrackedOrigin]()
            .unsafe_offset(i * scale_row),
            src=cache.scale_row(bs, tok),
            count=scale_row,
        )


def store_kv_into[
    collection_t: KVCollectionT, src_dtype: DType
](
    collection: collection_t,
    layer_idx: UInt32,
    keys: InputTensor[dtype=src_dtype, rank=3, ...],
    values: InputTensor[dtype=src_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    store_rows(
        collection.get_cache(layer, 0),
        collection.get_cache(layer, 1),
        keys,
        values,
        row_offsets,
    )


def store_kv_on[
    target: StaticString, collection_t: KVCollectionT, src_dtype: DType
](
    ctx: DeviceContext,
    collection: collection_t,
    layer_idx: UInt32,
    keys: InputTensor[dtype=src_dtype, rank=3, ...],
    values: InputTensor[dtype=src_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.store_kv` on the op's target: the CPU path, or the GPU kernel
    launched on `ctx` (`gpu.rows`, or `gpu.quantized` for a quantized cache)."""
    comptime if is_cpu[target]():
        store_kv_into(collection, layer_idx, keys, values, row_offsets)
    else:
        var launcher = GpuLauncher(ctx)
        comptime if is_quantized[collection_t.CacheType.dtype]():
            store_kv_quantized_gpu(launcher, collection, layer_idx, keys, values, row_offsets)
        elif src_dtype == collection_t.CacheType.dtype:
            store_kv_gpu(launcher, collection, layer_idx, keys, values, row_offsets)


@extensibility.register("mokv.store_kv")
struct StoreKV:
    """Stores a ragged batch's new K and V of one layer into the cache, paged
    or continuous-batching as the lookup table's rank says (`LayoutFor`)."""

    @staticmethod
    def execute[
        dtype: DType, table_rank: Int, target: StaticString
    ](
        blocks: _MutableInputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        keys: InputTensor[dtype=dtype, rank=3, ...],
        values: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        var collection = bind_collection(blocks, cache_lengths, lookup_table)
        store_kv_on[target](ctx, collection, layer_idx, keys, values, input_row_offsets)


@extensibility.register("mokv.store_kv.quantized")
struct StoreKVQuantized:
    """`mokv.store_kv` into a quantized cache: `float8_e4m3fn` or `int8`
    pages with their float32 scales (`bind_scales`), the new keys and
    values in the model's dtype, quantized as they are stored."""

    @staticmethod
    def execute[
        dtype: DType, cache_dtype: DType, table_rank: Int, target: StaticString
    ](
        blocks: _MutableInputTensor[dtype=cache_dtype, rank=6, ...],
        scales: _MutableInputTensor[dtype=DType.float32, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        keys: InputTensor[dtype=dtype, rank=3, ...],
        values: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        comptime code_dtype = codes_in[cache_dtype]()
        var collection = bind_collection[code_dtype](
            blocks, cache_lengths, lookup_table, bind_scales[code_dtype](blocks, scales)
        )
        store_kv_on[target](ctx, collection, layer_idx, keys, values, input_row_offsets)


def gather_rows_on[
    target: StaticString, cache_t: KVCacheT, dest_dtype: DType
](
    ctx: DeviceContext,
    cache: cache_t,
    dest: OutputTensor[dtype=dest_dtype, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`gather_rows` of one layer's cache on the op's target."""
    comptime if is_cpu[target]():
        gather_rows(cache, dest, batch_rows, positions)
    else:
        var launcher = GpuLauncher(ctx)
        comptime if is_quantized[cache_t.dtype]():
            gather_quantized_gpu(launcher, cache, dest, batch_rows, positions)
        elif dest_dtype == cache_t.dtype:
            gather_rows_gpu(launcher, cache, dest, batch_rows, positions)


@extensibility.register("mokv.gather")
struct Gather:
    """Reads token rows `(batch_rows[i], positions[i])` of one layer's K or V
    out of the cache (either layout, as `mokv.store_kv`) into a dense
    `[n, n_kv_heads, head_dim]` tensor."""

    @staticmethod
    def execute[
        dtype: DType, table_rank: Int, target: StaticString
    ](
        dest: OutputTensor[dtype=dtype, rank=3, ...],
        blocks: _MutableInputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
        positions: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        kv_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        var collection = bind_collection(blocks, cache_lengths, lookup_table)
        var cache = layer_cache(collection, layer_idx, kv_idx)
        gather_rows_on[target](ctx, cache, dest, batch_rows, positions)


@extensibility.register("mokv.gather.quantized")
struct GatherQuantized:
    """`mokv.gather` from a quantized cache: the rows dequantized into the
    output's dtype (float32 or bfloat16)."""

    @staticmethod
    def execute[
        dtype: DType, cache_dtype: DType, table_rank: Int, target: StaticString
    ](
        dest: OutputTensor[dtype=dtype, rank=3, ...],
        blocks: _MutableInputTensor[dtype=cache_dtype, rank=6, ...],
        scales: _MutableInputTensor[dtype=DType.float32, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
        positions: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        kv_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        comptime code_dtype = codes_in[cache_dtype]()
        var collection = bind_collection[code_dtype](
            blocks, cache_lengths, lookup_table, bind_scales[code_dtype](blocks, scales)
        )
        var cache = layer_cache(collection, layer_idx, kv_idx)
        gather_rows_on[target](ctx, cache, dest, batch_rows, positions)


@extensibility.register("mokv.gather.codes")
struct GatherCodes:
    """A quantized cache's token rows as stored: the codes `[n, n_kv_heads,
    head_dim]` in the cache's dtype and their float32 scales `[n,
    n_kv_heads, granules]`, for tests and inspection."""

    @staticmethod
    def execute[
        cache_dtype: DType, table_rank: Int, target: StaticString
    ](
        codes: OutputTensor[dtype=cache_dtype, rank=3, ...],
        row_scales: OutputTensor[dtype=DType.float32, rank=3, ...],
        blocks: _MutableInputTensor[dtype=cache_dtype, rank=6, ...],
        scales: _MutableInputTensor[dtype=DType.float32, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
        positions: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        kv_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        comptime code_dtype = codes_in[cache_dtype]()
        var collection = bind_collection[code_dtype](
            blocks, cache_lengths, lookup_table, bind_scales[code_dtype](blocks, scales)
        )
        var cache = layer_cache(collection, layer_idx, kv_idx)
        comptime if is_cpu[target]():
            gather_codes(cache, codes, row_scales, batch_rows, positions)
        else:
            var launcher = GpuLauncher(ctx)
            gather_codes_gpu(launcher, cache, codes, row_scales, batch_rows, positions)

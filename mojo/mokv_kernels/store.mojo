"""Writing a ragged batch's new keys/values into the cache, and reading token
rows back out (for tests, host offload and the inspector)."""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from std.memory import unsafe_memcpy

from .bind import (
    bind_collection,
    check_layer,
    check_row_offsets,
    check_rows,
    check_token_range,
)
from .cache import KVCacheT, KVCollectionT
from .gpu.block import GpuLauncher
from .gpu.rows import gather_gpu, gather_rows_gpu, store_kv_gpu


def store_rows[
    cache_t: KVCacheT
](
    k_cache: cache_t,
    v_cache: cache_t,
    keys: InputTensor[dtype=cache_t.dtype, rank=3, ...],
    values: InputTensor[dtype=cache_t.dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Copies each row's new keys and values to positions `cache_length ..
    cache_length + n` of its sequence in one pass over the new tokens: for
    each contiguous run (to the end of a page or slot), the keys and then
    the values. Every check runs before the first write."""
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
    var k_src = keys.unsafe_ptr()
    var v_src = values.unsafe_ptr()
    for bs in range(batch):
        var start = Int(offsets[unsafe_offset=bs])
        var n = Int(offsets[unsafe_offset=bs + 1]) - start
        var tok = k_cache.cache_length(bs)
        var done = 0
        while done < n:
            var run = min(n - done, k_cache.contiguous_tokens(tok + done))
            var src_offset = (start + done) * row
            unsafe_memcpy(
                dest=k_cache.row_ptr(bs, tok + done),
                src=k_src.unsafe_offset(src_offset),
                count=run * row,
            )
            unsafe_memcpy(
                dest=v_cache.row_ptr(bs, tok + done),
                src=v_src.unsafe_offset(src_offset),
                count=run * row,
            )
            done += run


def gather_rows[
    cache_t: KVCacheT
](
    cache: cache_t,
    dest: OutputTensor[dtype=cache_t.dtype, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """Copies token row `positions[i]` of batch row `batch_rows[i]` to
    `dest[i]`, for every i."""
    var row = cache.num_heads() * cache.head_dim()
    var n = dest.dim_size(0)
    var rows = batch_rows.unsafe_ptr()
    var pos = positions.unsafe_ptr()
    for i in range(n):
        var bs = Int(rows[unsafe_offset=i])
        var tok = Int(pos[unsafe_offset=i])
        check_token_range(cache, bs, tok, tok + 1)
    var dst = dest.unsafe_ptr()
    for i in range(n):
        unsafe_memcpy(
            dest=dst.unsafe_offset(i * row),
            src=cache.row_ptr(Int(rows[unsafe_offset=i]), Int(pos[unsafe_offset=i])),
            count=row,
        )


def store_kv_into[
    collection_t: KVCollectionT
](
    collection: collection_t,
    layer_idx: UInt32,
    keys: InputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    values: InputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
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
    target: StaticString, collection_t: KVCollectionT
](
    ctx: DeviceContext,
    collection: collection_t,
    layer_idx: UInt32,
    keys: InputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    values: InputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.store_kv` on the op's target: the CPU path, or the GPU kernel
    launched on `ctx` (`gpu.rows`)."""
    comptime if is_cpu[target]():
        store_kv_into(collection, layer_idx, keys, values, row_offsets)
    else:
        var launcher = GpuLauncher(ctx)
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


def gather_from[
    collection_t: KVCollectionT
](
    collection: collection_t,
    dest: OutputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    layer_idx: UInt32,
    kv_idx: UInt32,
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    if kv_idx > 1:
        raise Error(t"kv_idx must be 0 (keys) or 1 (values), got {kv_idx}")
    gather_rows(collection.get_cache(layer, Int(kv_idx)), dest, batch_rows, positions)


def gather_on[
    target: StaticString, collection_t: KVCollectionT
](
    ctx: DeviceContext,
    collection: collection_t,
    dest: OutputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    layer_idx: UInt32,
    kv_idx: UInt32,
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`mokv.gather` on the op's target (see `store_kv_on`)."""
    comptime if is_cpu[target]():
        gather_from(collection, dest, layer_idx, kv_idx, batch_rows, positions)
    else:
        var launcher = GpuLauncher(ctx)
        gather_gpu(launcher, collection, dest, layer_idx, kv_idx, batch_rows, positions)


def gather_rows_on[
    target: StaticString, cache_t: KVCacheT
](
    ctx: DeviceContext,
    cache: cache_t,
    dest: OutputTensor[dtype=cache_t.dtype, rank=3, ...],
    batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
    positions: InputTensor[dtype=DType.uint32, rank=1, ...],
) raises:
    """`gather_rows` of one layer's cache on the op's target."""
    comptime if is_cpu[target]():
        gather_rows(cache, dest, batch_rows, positions)
    else:
        var launcher = GpuLauncher(ctx)
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
        gather_on[target](ctx, collection, dest, layer_idx, kv_idx, batch_rows, positions)

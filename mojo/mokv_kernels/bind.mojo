"""Binding graph tensors to cache collections, with the bounds checks that keep
a bad page id or slot from ever becoming an out-of-bounds write."""

from extensibility import InputTensor, _MutableInputTensor

from .cache.batch_summary import BatchSummary
from .cache.collection import KVCacheCollection
from .cache.divisor import Divisor
from .cache.layout import CacheGeometry, ContinuousLayout, PagedLayout, ScaleTable
from .cache.traits import KVCacheT, KVCollectionT
from .kv_quantization import is_quantized


comptime LayoutFor[table_rank: Int] = PagedLayout if table_rank == 2 else ContinuousLayout
"""The layout that a lookup table of rank `table_rank` describes: `[batch,
max_pages_per_seq]` page ids (paged) or `[batch]` slots (continuous
batching). MAX infers `table_rank` from the graph tensor, so one op per
operation serves both layouts."""


def bind_collection[
    blocks_dtype: DType, table_rank: Int, //, dtype: DType = blocks_dtype
](
    blocks: _MutableInputTensor[dtype=blocks_dtype, rank=6, ...],
    cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
    lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
    scales: Optional[ScaleTable] = None,
) raises -> KVCacheCollection[dtype, LayoutFor[table_rank]]:
    """The collection over the page tensor `blocks` (and, quantized, `scales`: see
    `bind_scales`) for the batch that `cache_lengths` `[batch]` and
    `lookup_table` describe, in the layout the table's rank names
    (`LayoutFor`). Its elements are `dtype`: the pages' own, or the codes
    their bits hold (`kv_quantization.codes_in`)."""
    comptime assert (
        table_rank == 1 or table_rank == 2
    ), "lookup_table is [batch, max_pages_per_seq] (paged) or [batch] (continuous batching)"
    if lookup_table.dim_size(0) != cache_lengths.dim_size(0):
        raise Error(
            t"lookup_table has {lookup_table.dim_size(0)} rows but"
            t" cache_lengths has {cache_lengths.dim_size(0)}"
        )
    var page_len = blocks.dim_size(3)
    var columns = 1
    comptime if table_rank == 2:
        columns = lookup_table.dim_size(1)
    if page_len < 1 or columns * page_len >= 1 << 31:
        raise Error(
            t"a sequence of {columns} pages of {page_len} tokens: a sequence holds"
            t" between 1 and 2^31 - 1 tokens"
        )
    var base = blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var geometry = CacheGeometry(
        base.unsafe_bitcast[UInt8](),
        blocks.dim_size(0),
        blocks.dim_size(2),
        page_len,
        Divisor.of(page_len),
        blocks.dim_size(4),
        blocks.dim_size(5),
        cache_lengths.dim_size(0),
        cache_lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        lookup_table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        scales.value() if scales else ScaleTable.empty(base.unsafe_bitcast[Float32]()),
    )
    comptime if table_rank == 2:
        var paged = PagedLayout(lookup_table.dim_size(1))
        return KVCacheCollection[dtype](geometry, rebind[LayoutFor[table_rank]](paged))
    else:
        return KVCacheCollection[dtype](geometry, rebind[LayoutFor[table_rank]](ContinuousLayout()))


def bind_scales[
    dtype: DType
](
    blocks: _MutableInputTensor[rank=6, ...],
    scales: _MutableInputTensor[dtype=DType.float32, rank=6, ...],
) raises -> ScaleTable:
    """The scale table of a quantized cache: float32 `[num_pages, 2,
    num_layers, page_len // tokens_per_scale, n_kv_heads, granules]`,
    checked against `blocks`, its scale-block shape read off its dims."""
    comptime assert is_quantized[dtype](), "only float8_e4m3fn and int8 pages have scales"
    var page_len = blocks.dim_size(3)
    var head_dim = blocks.dim_size(5)
    var shape_ok = (
        scales.dim_size(0) == blocks.dim_size(0)
        and scales.dim_size(1) == 2
        and scales.dim_size(2) == blocks.dim_size(2)
        and scales.dim_size(4) == blocks.dim_size(4)
    )
    var rows = scales.dim_size(3)
    var granules = scales.dim_size(5)
    if (
        not shape_ok
        or rows == 0
        or page_len % rows != 0
        or granules == 0
        or head_dim % granules != 0
    ):
        raise Error(
            t"scales have shape [{scales.dim_size(0)}, {scales.dim_size(1)},"
            t" {scales.dim_size(2)}, {rows}, {scales.dim_size(4)}, {granules}], which does"
            t" not fit blocks [{blocks.dim_size(0)}, 2, {blocks.dim_size(2)}, {page_len},"
            t" {blocks.dim_size(4)}, {head_dim}]: expected [{blocks.dim_size(0)}, 2,"
            t" {blocks.dim_size(2)}, a divisor of {page_len}, {blocks.dim_size(4)}, a"
            t" divisor of {head_dim}]"
        )
    return ScaleTable.of(
        scales.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), page_len, rows, granules
    )


def bind_summary[
    table_rank: Int, dtype: DType, rank: Int
](summary: InputTensor[dtype=dtype, rank=rank, ...]) raises -> BatchSummary:
    """The batch summary that the fourth graph input of a cache states: for
    a paged cache (`table_rank` 2) `max_lengths`, uint32 `[num_steps, 2]`,
    whose row 0 is this step's; for continuous batching `is_cache_empty`, a
    bool scalar (which MAX hands an op as a one-element tensor)."""
    var values = summary.unsafe_ptr()
    comptime if table_rank == 2:
        comptime assert (
            dtype == DType.uint32 and rank == 2
        ), "a paged cache's fourth input is max_lengths, uint32 [num_steps, 2]"
        if summary.dim_size(0) == 0 or summary.dim_size(1) != 2:
            raise Error(
                t"max_lengths has shape [{summary.dim_size(0)}, {summary.dim_size(1)}], not"
                t" [num_steps >= 1, 2]"
            )
        var max_new_tokens = Int(values[unsafe_offset=0].cast[DType.uint32]())
        var max_context = Int(values[unsafe_offset=1].cast[DType.uint32]())
        return BatchSummary.of_max_lengths(max_new_tokens, max_context)
    else:
        comptime assert (
            dtype == DType.bool and rank <= 1
        ), "a continuous-batching cache's fourth input is is_cache_empty, a bool scalar"
        return BatchSummary.of_is_cache_empty(Bool(values[unsafe_offset=0].cast[DType.bool]()))


def layer_cache[
    collection_t: KVCollectionT
](collection: collection_t, layer_idx: UInt32, kv_idx: UInt32) raises -> collection_t.CacheType:
    """Layer `layer_idx`'s keys (`kv_idx` 0) or values (1), both checked."""
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    if kv_idx > 1:
        raise Error(t"kv_idx must be 0 (keys) or 1 (values), got {kv_idx}")
    return collection.get_cache(layer, Int(kv_idx))


def check_layer(layer: Int, num_layers: Int) raises:
    if layer < 0 or layer >= num_layers:
        raise Error(t"layer_idx {layer} out of range for {num_layers} layers")


def check_scale(scale: Float32) raises:
    """Attention's softmax scale is positive and finite: the GPU kernels
    take a row's max of the products before scaling them, which only a
    positive scale leaves the max of the scaled scores. The graph builder
    checks a constant scale; a run-time input reaches only this check."""
    if not (scale > 0 and scale <= Float32.MAX_FINITE):  # NaN compares false
        raise Error(t"scale {scale} is not a positive finite number")


def check_token_range[cache_t: KVCacheT](cache: cache_t, bs: Int, start: Int, end: Int) raises:
    """Raises unless `bs` is a row of the batch and tokens `start..end` of it
    map to valid pages."""
    if bs < 0 or bs >= cache.batch_size():
        raise Error(t"batch row {bs} out of range for {cache.batch_size()} rows")
    if end > cache.max_tokens():
        raise Error(
            t"row {bs}: token {end - 1} is past the {cache.max_tokens()}"
            t" tokens its lookup-table row can address"
        )
    var tok = start
    while tok < end:
        var page = cache.page_index(bs, tok)
        if page < 0 or page >= cache.num_pages():
            raise Error(
                t"row {bs}: page id {page} for token {tok} is outside the"
                t" page tensor ({cache.num_pages()} pages)"
            )
        tok += cache.contiguous_tokens(tok)


def check_rows[
    cache_t: KVCacheT
](cache: cache_t, rows: InputTensor[rank=3, ...], name: StaticString) raises:
    """Raises unless `rows` is `[tokens, n_kv_heads, head_dim]` of the cache."""
    if rows.dim_size(1) != cache.num_heads() or rows.dim_size(2) != cache.head_dim():
        raise Error(
            t"{name} has shape [*, {rows.dim_size(1)}, {rows.dim_size(2)}] but"
            t" the cache rows are [*, {cache.num_heads()}, {cache.head_dim()}]"
        )


def check_row_offsets(
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    batch: Int,
    total_tokens: Int,
) raises:
    """Raises unless `row_offsets` is `[batch + 1]`, starts at 0, never
    decreases and ends at `total_tokens`."""
    if row_offsets.dim_size(0) != batch + 1:
        raise Error(
            t"input_row_offsets has {row_offsets.dim_size(0)} entries but the"
            t" cache describes {batch} rows (expected {batch + 1})"
        )
    var offsets = row_offsets.unsafe_ptr()
    if offsets[unsafe_offset=0] != 0:
        raise Error(t"input_row_offsets starts at {offsets[unsafe_offset=0]}, not 0")
    for b in range(batch):
        if offsets[unsafe_offset=b + 1] < offsets[unsafe_offset=b]:
            raise Error(
                t"input_row_offsets decreases at row {b}:"
                t" {offsets[unsafe_offset=b]} then {offsets[unsafe_offset=b + 1]}"
            )
    if Int(offsets[unsafe_offset=batch]) != total_tokens:
        raise Error(
            t"input_row_offsets ends at {offsets[unsafe_offset=batch]} but there"
            t" are {total_tokens} new tokens"
        )

"""The attention ops: every input checked against the cache, then the batch's
work items run in parallel and the split ones merged."""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level

from ..bind import (
    bind_collection,
    bind_scales,
    bind_summary,
    check_layer,
    check_row_offsets,
    check_scale,
    check_token_range,
)
from ..cache.batch_summary import BatchSummary
from ..cache.traits import KVCacheT, KVCollectionT
from ..gpu.attention import attention_gpu
from ..gpu.block import GpuLauncher
from ..kv_quantization import codes_in, is_quantized
from ..parallel import Job, run_items
from ..pointers import F32Ptr
from .config import HEAD_DIM_MULTIPLE, LOG2E, PARALLEL_MIN_PRODUCTS, W
from .decode import _decode_any_group
from .plan import WorkItem, _plan, _scores
from .prefill import _prefill_item
from .queries import RaggedQueries
from .scratch import Arena
from .softmax import SplitGroup, _merge_splits


@fieldwise_init
struct _AttendItems[q_dtype: DType, cache_t: KVCacheT](Job):
    """The batch's work items, decode or prefill, each into its output or partials."""

    var k_cache: Self.cache_t
    var v_cache: Self.cache_t
    var queries: RaggedQueries[Self.q_dtype]
    var items: Pointer[WorkItem, MutUntrackedOrigin]
    var partials: F32Ptr

    def run(self, i: Int):
        var item = self.items[unsafe_offset=i]
        if item.kv_head >= 0:
            _prefill_item(self.k_cache, self.v_cache, self.queries, item, self.partials)
        else:
            _decode_any_group(self.k_cache, self.v_cache, self.queries, item, self.partials)


@fieldwise_init
struct _MergeSplits[q_dtype: DType](Job):
    """The split items' partial states, merged into the outputs."""

    var queries: RaggedQueries[Self.q_dtype]
    var groups: Pointer[SplitGroup, MutUntrackedOrigin]
    var partials: F32Ptr

    def run(self, i: Int):
        _merge_splits(self.queries, self.groups[unsafe_offset=i], self.partials)


def attention_over[
    collection_t: KVCollectionT, q_dtype: DType
](
    collection: collection_t,
    summary: BatchSummary,
    output: OutputTensor[dtype=q_dtype, rank=3, ...],
    q: InputTensor[dtype=q_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    layer_idx: UInt32,
    scale: Float32,
    sliding_window: UInt32,
) raises:
    """Checks every input against the cache and every row against the batch
    summary, then runs the batch's work items in parallel (`run_items`) and
    merges the split ones."""
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    check_scale(scale)
    var k_cache = collection.get_cache(layer, 0)
    var v_cache = collection.get_cache(layer, 1)
    var batch = k_cache.batch_size()
    var n_kv = k_cache.num_heads()
    var d = k_cache.head_dim()
    var n_q = q.dim_size(1)
    if q.dim_size(2) != d:
        raise Error(t"q has head_dim {q.dim_size(2)} but the cache rows have {d}")
    if n_q == 0 or n_q % n_kv != 0:
        raise Error(t"q has {n_q} heads, not a positive multiple of the cache's {n_kv} KV heads")
    comptime assert HEAD_DIM_MULTIPLE % W == 0, "float32 vectors wider than HEAD_DIM_MULTIPLE"
    if d % HEAD_DIM_MULTIPLE != 0:
        raise Error(t"head_dim {d} is not a multiple of {HEAD_DIM_MULTIPLE}")
    comptime if is_quantized[collection_t.CacheType.dtype]():
        var granularity = d // k_cache.scales().granules
        if granularity % HEAD_DIM_MULTIPLE != 0:
            raise Error(
                t"the quantization granularity {granularity} (head_dim {d} over"
                t" {k_cache.scales().granules} scales) is not a multiple of {HEAD_DIM_MULTIPLE}"
            )
    check_row_offsets(row_offsets, batch, q.dim_size(0))

    var queries = RaggedQueries[q_dtype](
        q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        n_q,
        n_q // n_kv,
        d,
        scale * LOG2E,
        Int(sliding_window),
    )
    for b in range(batch):
        var new_tokens = queries.token(b + 1, 0) - queries.token(b, 0)
        var cache_length = k_cache.cache_length(b)
        summary.check_row(b, cache_length, new_tokens)
        if new_tokens > 0:
            check_token_range(
                k_cache, b, queries.visible_start(cache_length), cache_length + new_tokens
            )

    var items = List[WorkItem]()
    var groups = List[SplitGroup]()
    var partial_floats = _plan(
        k_cache, queries, summary, batch, parallelism_level(None), items, groups
    )
    var partials_arena = Arena(partial_floats)
    var partials = partials_arena.take(partial_floats)
    var products = 0
    for item in items:
        products += 2 * d * _scores(item, queries)
    var helpers = Int.MAX if products >= PARALLEL_MIN_PRODUCTS else 0
    run_items(
        _AttendItems(
            k_cache,
            v_cache,
            queries,
            items.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            partials,
        ),
        len(items),
        helpers,
    )
    run_items(
        _MergeSplits(
            queries, groups.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), partials
        ),
        len(groups),
        helpers,
    )
    _ = partials_arena^
    _ = items^
    _ = groups^


def attention_on[
    target: StaticString, collection_t: KVCollectionT, q_dtype: DType
](
    ctx: DeviceContext,
    collection: collection_t,
    summary: BatchSummary,
    output: OutputTensor[dtype=q_dtype, rank=3, ...],
    q: InputTensor[dtype=q_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    layer_idx: UInt32,
    scale: Float32,
    sliding_window: UInt32,
) raises:
    """`mokv.attention` on the op's target: the CPU path, or the GPU kernels
    launched on `ctx` (`gpu.attention`), whose grid the summary sizes."""
    comptime if is_cpu[target]():
        attention_over(
            collection, summary, output, q, row_offsets, layer_idx, scale, sliding_window
        )
    else:
        comptime cache_dtype = collection_t.CacheType.dtype
        comptime if q_dtype == cache_dtype or is_quantized[cache_dtype]():
            var launcher = GpuLauncher(ctx)
            attention_gpu(
                launcher,
                collection,
                output,
                q,
                row_offsets,
                layer_idx,
                scale,
                sliding_window,
                summary,
            )


@extensibility.register("mokv.attention")
struct Attention:
    """Flash attention of a ragged batch over one layer of the cache, paged or
    continuous-batching as the lookup table's rank says (`LayoutFor`).

    The cache's fourth input is the host's summary of the batch
    (`bind_summary`): for a paged cache `max_lengths` (uint32
    `[num_steps, 2]`; row 0 holds the most new tokens of any row and the
    longest context including them, or upper bounds on both), for continuous
    batching `is_cache_empty` (bool, true only when every cache length is 0).
    Before the first write the op raises, naming the row and the values, if a
    row has more new tokens than `max_lengths[0, 0]`, more cached plus new
    tokens than `max_lengths[0, 1]`, or a nonzero cache length while
    `is_cache_empty` is true. The planner takes the summary's word where it
    saves work (`_plan`)."""

    @staticmethod
    def execute[
        dtype: DType,
        table_rank: Int,
        summary_dtype: DType,
        summary_rank: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        blocks: _MutableInputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        batch_summary: InputTensor[dtype=summary_dtype, rank=summary_rank, ...],
        q: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        sliding_window: UInt32,
        ctx: DeviceContext,
    ) raises:
        var collection = bind_collection(blocks, cache_lengths, lookup_table)
        var summary = bind_summary[table_rank](batch_summary)
        attention_on[target](
            ctx,
            collection,
            summary,
            output,
            q,
            input_row_offsets,
            layer_idx,
            scale,
            sliding_window,
        )


@extensibility.register("mokv.attention.quantized")
struct AttentionQuantized:
    """`mokv.attention` over a quantized cache: `float8_e4m3fn` or `int8`
    pages with their float32 scales (`bind_scales`), queries and output in
    the model's dtype. Codes are widened and scaled in registers as they are
    read (`decode`), or per tile into a prefill item's scratch (`prefill`)."""

    @staticmethod
    def execute[
        dtype: DType,
        cache_dtype: DType,
        table_rank: Int,
        summary_dtype: DType,
        summary_rank: Int,
        target: StaticString,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        blocks: _MutableInputTensor[dtype=cache_dtype, rank=6, ...],
        scales: _MutableInputTensor[dtype=DType.float32, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=table_rank, ...],
        batch_summary: InputTensor[dtype=summary_dtype, rank=summary_rank, ...],
        q: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        sliding_window: UInt32,
        ctx: DeviceContext,
    ) raises:
        comptime code_dtype = codes_in[cache_dtype]()
        var collection = bind_collection[code_dtype](
            blocks, cache_lengths, lookup_table, bind_scales[code_dtype](blocks, scales)
        )
        var summary = bind_summary[table_rank](batch_summary)
        attention_on[target](
            ctx,
            collection,
            summary,
            output,
            q,
            input_row_offsets,
            layer_idx,
            scale,
            sliding_window,
        )

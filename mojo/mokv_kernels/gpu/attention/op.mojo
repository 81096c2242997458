"""`mokv.attention` on a GPU: the host checks shapes and heads, plans the
grid from the batch summary (`plan`), and launches the decode or a prefill
kernel (on tensor cores for bfloat16 where the device has them), then the
split-K merge when the context was split."""

from extensibility import InputTensor, OutputTensor

from ...bind import check_layer
from ...cache import BatchSummary, CachePtr, KVCacheT, KVCollectionT
from ..block import Launcher
from .config import LOG2E
from .decode import DecodeKernel
from .merge import MergeArgs, MergeKernel
from .plan import BatchBounds, plan_attention
from .prefill import AttentionKernel
from .prefill_mma import MmaPrefillKernel
from .work import AttentionArgs


def _prefill_rows(head_dim: Int) -> Int:
    """Query rows of a prefill block: 64, or 32 for head_dim 256 (shared
    memory)."""
    return 32 if head_dim > 128 else 64


def _launch_mma_prefill[
    D: Int, cache_t: KVCacheT, L: Launcher
](mut launcher: L, args: AttentionArgs[cache_t], query_tiles: Int) raises -> Bool:
    """Launches the tensor-core prefill (`prefill_mma`) where it runs: a
    bfloat16 cache with head_dim up to 128, on a launcher with tensor cores.
    Returns whether it did."""
    comptime if cache_t.dtype == DType.bfloat16 and D <= 128:
        if launcher.tensor_cores():
            launcher.launch(MmaPrefillKernel[cache_t, D, L.LANES](args, query_tiles))
            return True
    return False


def _run[
    cache_t: KVCacheT, D: Int, L: Launcher
](mut launcher: L, var args: AttentionArgs[cache_t], bounds: BatchBounds) raises:
    var batch = args.k_cache.batch_size()
    var plan = plan_attention(
        batch,
        args.k_cache.num_heads(),
        args.group,
        _prefill_rows(D),
        bounds,
        launcher.multiprocessors(),
    )
    args.tokens_per_tile = plan.tokens_per_tile
    args.splits = plan.splits
    if plan.splits > 1:
        args.partials = launcher.scratch(plan.splits * args.total_tokens * args.n_q_heads * (D + 2))
    if plan.decode:
        launcher.launch(DecodeKernel[cache_t, D](args, plan.query_tiles))
    elif not _launch_mma_prefill[D](launcher, args, plan.query_tiles):
        comptime rows = 32 if D > 128 else 64
        launcher.launch(AttentionKernel[cache_t, D, rows, 32, 4](args, plan.query_tiles))
    if plan.splits > 1:
        launcher.launch(
            MergeKernel[cache_t.dtype, D](
                MergeArgs[cache_t.dtype](
                    args.partials,
                    args.out,
                    args.total_tokens,
                    args.n_q_heads,
                    plan.splits,
                )
            )
        )


def attention_gpu[
    collection_t: KVCollectionT, L: Launcher, q_dtype: DType
](
    mut launcher: L,
    collection: collection_t,
    output: OutputTensor[dtype=q_dtype, rank=3, ...],
    q: InputTensor[dtype=q_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    layer_idx: UInt32,
    scale: Float32,
    sliding_window: UInt32,
    summary: BatchSummary,
) raises:
    """`mokv.attention` on a GPU. The host checks shapes and heads; the grid
    comes from the batch summary (see the module docstring)."""
    comptime cache_t = collection_t.CacheType
    comptime assert q_dtype == cache_t.dtype, "the GPU path reads unquantized caches only"
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    var k_cache = collection.get_cache(layer, 0)
    var batch = k_cache.batch_size()
    var n_kv = k_cache.num_heads()
    var d = k_cache.head_dim()
    var tokens = q.dim_size(0)
    var n_q = q.dim_size(1)
    if q.dim_size(2) != d:
        raise Error(t"q has head_dim {q.dim_size(2)} but the cache rows have {d}")
    if n_q == 0 or n_q % n_kv != 0:
        raise Error(t"q has {n_q} heads, not a positive multiple of the cache's {n_kv} KV heads")
    if output.dim_size(0) != tokens or output.dim_size(1) != n_q or output.dim_size(2) != d:
        raise Error(
            t"the output has shape [{output.dim_size(0)}, {output.dim_size(1)},"
            t" {output.dim_size(2)}], expected q's [{tokens}, {n_q}, {d}]"
        )
    if row_offsets.dim_size(0) != batch + 1:
        raise Error(
            t"input_row_offsets has {row_offsets.dim_size(0)} entries but the"
            t" cache describes {batch} rows (expected {batch + 1})"
        )
    var group = n_q // n_kv
    if group > _prefill_rows(d):
        raise Error(
            t"{group} query heads per KV head: the GPU kernel takes at most {_prefill_rows(d)}"
        )
    if tokens == 0 or batch == 0:
        return
    var bounds = BatchBounds.of(summary, tokens, k_cache.max_tokens())
    var args = AttentionArgs[cache_t](
        k_cache,
        collection.get_cache(layer, 1),
        rebind[CachePtr[cache_t.dtype]](q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()),
        rebind[CachePtr[cache_t.dtype]](
            output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        ),
        row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Float32](),
        tokens,
        n_q,
        group,
        scale * LOG2E,
        Int(sliding_window),
        1,
        1,
    )
    if d == 64:
        _run[cache_t, 64](launcher, args, bounds)
    elif d == 128:
        _run[cache_t, 128](launcher, args, bounds)
    elif d == 256:
        _run[cache_t, 256](launcher, args, bounds)
    else:
        raise Error(t"head_dim {d}: the GPU attention kernel takes 64, 128 or 256")

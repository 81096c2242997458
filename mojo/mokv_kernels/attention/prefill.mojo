"""Prefill items: blocks of new tokens per KV head.

Prefill rows (several new tokens) are cut into blocks of query tokens per KV
head. Queries are transposed once per item, so both products are
register-blocked broadcast-FMA loops with no horizontal sums; each tile's
head segment of K and V is copied (as float32, dequantized from a quantized
cache's codes) into a tile of scratch whose rows, unlike the cache's, do not
all share a few L1 sets.
"""

from std.math import ceildiv

from ..cache.traits import KVCacheT
from ..kv_quantization import is_quantized, widen, widened_unit
from ..pointers import F32Ptr
from .config import (
    NEG_INF,
    PV_ROWS,
    PV_VECS,
    QK_TOKENS,
    QK_VECS,
    SKEW,
    TILE,
    Vec,
    W,
)
from .plan import WorkItem
from .queries import RaggedQueries
from .scratch import Arena, _round_up
from .softmax import PartialState, SoftmaxState
from .tiles import RowPtrs, ScaleRows, TileWalk


def _qk_block(
    q_t: F32Ptr,
    q_stride: Int,
    keys: F32Ptr,
    key_stride: Int,
    j0: Int,
    state: SoftmaxState,
    r0: Int,
    head_dim: Int,
):
    """Scores of rows `r0 ..< r0 + QK_VECS*W` against staged tile tokens `j0
    ..< j0 + QK_TOKENS` (`key_stride` floats apart): per head_dim element, one
    broadcast key element times one vector of transposed queries `q_t
    [head_dim, rows]` (rows `q_stride` floats apart) per FMA."""
    var acc = Array[Vec, QK_TOKENS * QK_VECS](fill=Vec(0))
    for i in range(head_dim):
        var q = Array[Vec, QK_VECS](fill=Vec(0))
        comptime for v in range(QK_VECS):
            q[v] = q_t.unsafe_load[width=W](i * q_stride + r0 + v * W)
        comptime for t in range(QK_TOKENS):
            var k = Vec(keys[unsafe_offset=(j0 + t) * key_stride + i])
            comptime for v in range(QK_VECS):
                acc[t * QK_VECS + v] = k.fma(q[v], acc[t * QK_VECS + v])
    comptime for t in range(QK_TOKENS):
        comptime for v in range(QK_VECS):
            state.column(j0 + t).unsafe_store(r0 + v * W, acc[t * QK_VECS + v])


def _pv_block[
    NV: Int
](state: SoftmaxState, r0: Int, values: F32Ptr, value_stride: Int, col: Int, n: Int):
    """Adds probabilities `[rows r0 ..< r0 + PV_ROWS, tokens 0 ..< n]` times
    value columns `col ..< col + NV*W` of the staged tile (rows `value_stride`
    floats apart) to those rows' outputs, held in registers across the tile."""
    var out = Array[Vec, PV_ROWS * NV](fill=Vec(0))
    comptime for r in range(PV_ROWS):
        comptime for v in range(NV):
            out[r * NV + v] = state.acc_row(r0 + r).unsafe_load[width=W](col + v * W)
    for j in range(n):
        var vals = Array[Vec, NV](fill=Vec(0))
        comptime for v in range(NV):
            vals[v] = values.unsafe_load[width=W](j * value_stride + col + v * W)
        var probs = state.column(j).unsafe_offset(r0)
        comptime for r in range(PV_ROWS):
            var p = Vec(probs[unsafe_offset=r])
            comptime for v in range(NV):
                out[r * NV + v] = p.fma(vals[v], out[r * NV + v])
    comptime for r in range(PV_ROWS):
        comptime for v in range(NV):
            state.acc_row(r0 + r).unsafe_store(col + v * W, out[r * NV + v])


def _stage_tile[
    dtype: DType
](
    rows: RowPtrs[dtype],
    scales: ScaleRows,
    head: Int,
    n: Int,
    head_dim: Int,
    granules: Int,
    staging: F32Ptr,
    stride: Int,
):
    """Copies head `head` of the tile's first `n` rows into `staging` (`TILE`
    rows `stride` floats apart) as float32, codes of a quantized cache
    dequantized with their `granules` scales per head. Copied even for
    float32 storage: cache rows of 8 heads x 128 floats lie 4 KB apart, so a
    tile's segments would all fall into the same L1 sets and evict each other
    between register blocks. Rows past `n` keep an earlier tile's values (or
    zeros): score blocks that run over the end of a partial tile compute
    columns that the softmax never reads."""
    comptime quantized = is_quantized[dtype]()
    var granularity = head_dim // granules
    for j in range(n):
        var src = rows[j].unsafe_offset(head * head_dim)
        var dst = staging.unsafe_offset(j * stride)
        for granule in range(granules):
            var scale = Vec(1)
            comptime if quantized:
                scale = Vec(
                    scales[j][unsafe_offset=head * granules + granule] * widened_unit[dtype]()
                )
            for i in range(granule * granularity, (granule + 1) * granularity, W):
                var values = widen(src.unsafe_load[width=W](i))
                comptime if quantized:
                    values *= scale
                dst.unsafe_store(i, values)


def _prefill_item[
    q_dtype: DType, //, cache_t: KVCacheT
](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[q_dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    """Runs a prefill item: query rows are (token, head of the KV head's
    group) pairs, token-major, padded with zero rows to the register blocks;
    masks apply only to tiles on the causal diagonal or the window's edge."""
    var d = queries.head_dim
    var granules = k_cache.scales().granules if is_quantized[cache_t.dtype]() else 1
    var group = queries.group
    var h = item.kv_head
    var rows = item.num_tokens * group
    var padded = _round_up(rows, QK_VECS * W)
    var first_position = k_cache.cache_length(item.row) + item.first_token

    var q_stride = padded + SKEW
    var tile_stride = d + SKEW  # of the staged K and V tiles
    var arena = Arena(
        d * (q_stride + group) + SoftmaxState.floats(padded, d) + 2 * TILE * tile_stride
    )
    var q_t = arena.take(d * q_stride)
    var scratch = arena.take(d * group)
    for t in range(item.num_tokens):
        queries.load_rows(scratch, queries.token(item.row, item.first_token + t), h * group, group)
        for g in range(group):
            for i in range(d):
                q_t[unsafe_offset=i * q_stride + t * group + g] = scratch[unsafe_offset=g * d + i]
    var state = SoftmaxState.take(arena, padded, d)
    var k_staging = arena.take(TILE * tile_stride)
    var v_staging = arena.take(TILE * tile_stride)
    # Visible positions `lo ..< hi` per row; padding rows see everything.
    var bounds = List[Int32](length=2 * padded, fill=0)
    var lo = bounds.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var hi = lo.unsafe_offset(padded)
    for r in range(padded):
        var position = first_position + r // group
        lo[unsafe_offset=r] = Int32(queries.visible_start(position)) if r < rows else 0
        hi[unsafe_offset=r] = Int32(position + 1) if r < rows else Int32.MAX
    var last_position = first_position + item.num_tokens - 1
    var all_see_from = queries.visible_start(last_position)  # max over rows of lo

    var walk = TileWalk(k_cache, v_cache, item.row, item.ctx_start, item.ctx_end)
    var prefetch_rows = ceildiv(TILE, padded // PV_ROWS)  # next-tile rows per value block
    while walk.advance():
        var pos = walk.pos
        var n = walk.n
        _stage_tile(walk.k_rows, walk.k_scales, h, n, d, granules, k_staging, tile_stride)
        _stage_tile(walk.v_rows, walk.v_scales, h, n, d, granules, v_staging, tile_stride)
        for r0 in range(0, padded, QK_VECS * W):
            for j0 in range(0, n, QK_TOKENS):
                _qk_block(q_t, q_stride, k_staging, tile_stride, j0, state, r0, d)
        if pos < all_see_from or pos + n > first_position + 1:
            for j in range(n):
                var p = SIMD[DType.int32, W](Int32(pos + j))
                var column = state.column(j)
                for r in range(0, padded, W):
                    var seen = p.ge(lo.unsafe_load[width=W](r)) & p.lt(hi.unsafe_load[width=W](r))
                    column.unsafe_store(
                        r, seen.select(column.unsafe_load[width=W](r), Vec(NEG_INF))
                    )
        state.update(n)
        for r0 in range(0, padded, PV_ROWS):
            for j in range(r0 // PV_ROWS * prefetch_rows, (r0 // PV_ROWS + 1) * prefetch_rows):
                walk.prefetch_next(j, h * d, d)
            var col = 0
            while col + PV_VECS * W <= d:
                _pv_block[PV_VECS](state, r0, v_staging, tile_stride, col, n)
                col += PV_VECS * W
            while col < d:
                _pv_block[1](state, r0, v_staging, tile_stride, col, n)
                col += W

    for t in range(item.num_tokens):
        var token = queries.token(item.row, item.first_token + t)
        for g in range(group):
            var r = t * group + g
            if item.split < 0:
                queries.store_row(
                    token, h * group + g, state.acc_row(r), 1 / state.row_sum[unsafe_offset=r]
                )
            else:
                PartialState(partials.unsafe_offset(item.split), rows, d).save(r, state, r)
    _ = bounds^
    _ = arena^

"""Decode items: one new token, context rows walked in place.

Decode rows (one new token) walk each context token's whole
`[n_kv_heads, head_dim]` row in memory order, with all query heads of a KV
head updated per loaded key/value vector (GQA reuse). Decode is bound by
memory traffic, and this is the access pattern that streams.
"""

from std.sys import prefetch

from ..cache.traits import KVCacheT
from ..pointers import F32Ptr, ScalePtr
from ..kv_quantization import is_quantized, widen, widened_unit
from .config import Vec, W
from .plan import WorkItem
from .queries import RaggedQueries
from .scratch import Arena, _round_up
from .softmax import PartialState, SoftmaxState
from .tiles import RowBlock, TileWalk, _offset_rows


def _ceil_log2(n: Int) -> Int:
    var k = 0
    while (1 << k) < n:
        k += 1
    return k


def _pair_sums(a: Vec, b: Vec) -> Vec:
    """Sums of adjacent lanes: lane k < W/2 holds a[2k] + a[2k+1], lane
    W/2 + k holds b[2k] + b[2k+1]."""
    var evens, odds = a.join(b).deinterleave()
    return rebind[Vec](evens + odds)


def _lane_sums[N: Int](values: Array[Vec, N]) -> Vec:
    """Lane k holds the sum of all lanes of `values[k]` (k < N): a tree of
    pairwise sums, a few instructions per vector where N separate
    horizontal reductions would cost a shuffle ladder each."""
    comptime assert N <= W, "more vectors than lanes to sum them into"
    comptime LEVELS = _ceil_log2(N)
    var level = Array[Vec, 1 << LEVELS](fill=Vec(0))
    comptime for k in range(N):
        level[k] = values[k]
    comptime for l in range(LEVELS):
        comptime for k in range((1 << LEVELS) >> (l + 1)):
            level[k] = _pair_sums(level[2 * k], level[2 * k + 1])
    # Fewer vectors than lanes: each sum is still spread over W / 2^LEVELS lanes.
    comptime for _ in range(_ceil_log2(W) - LEVELS):
        level[0] = _pair_sums(level[0], level[0])
    return level[0]


def _decode_tokens(group_block: Int) -> Int:
    """Context tokens per register block of a decode item: as many as the
    vector registers hold accumulators for (`group_block` query heads each),
    and at least 8 accumulators where they fit, since each FMA chain waits
    ~4 cycles for the last and two FMAs issue per cycle. A divisor of `TILE`."""
    if W >= 16:
        return 4 if group_block <= 4 else 2
    if group_block <= 3:
        return 4
    return 2 if group_block <= 4 else 1


def _decode_item[
    q_dtype: DType, //, cache_t: KVCacheT, GB: Int, PER_VECTOR: Bool
](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[q_dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    """Runs a decode item. Query heads of a KV head are processed `GB` at a
    time (padded with zero rows up to a multiple of `GB`) against `JB` context
    tokens at a time, so every loaded key or value vector feeds `GB` FMAs and
    every output vector stays in a register across `JB` tokens. bfloat16
    rows and 8-bit codes are widened vector by vector as they are loaded.
    A code's scale is applied where it costs least: with one scale per head
    row, to the finished score (keys) and to the probability (values), a
    multiply per token instead of per vector; with several (`PER_VECTOR`),
    to each widened vector."""
    comptime JB = _decode_tokens(GB)
    comptime AHEAD = 8  # tokens between the rows read and the rows prefetched
    comptime quantized = is_quantized[cache_t.dtype]()
    comptime unit = widened_unit[cache_t.dtype]()
    var n_kv = k_cache.num_heads()
    var d = queries.head_dim
    var granules = k_cache.scales().granules if quantized else 1
    var granularity = d // granules
    var group = queries.group
    var padded = _round_up(group, GB)
    var rows = _round_up(n_kv * padded, W)
    var token = queries.token(item.row, item.first_token)

    var arena = Arena(rows * d + SoftmaxState.floats(rows, d))
    var q = arena.take(rows * d)
    for h in range(n_kv):
        queries.load_rows(q.unsafe_offset(h * padded * d), token, h * group, group)
    var state = SoftmaxState.take(arena, rows, d)
    var walk = TileWalk(k_cache, v_cache, item.row, item.ctx_start, item.ctx_end)
    while walk.advance():
        var n = walk.n
        for j0 in range(0, n, JB):
            var k_block = RowBlock[cache_t.dtype, JB](fill=walk.k_row(j0))
            var k_later = RowBlock[cache_t.dtype, JB](fill=walk.k_row(j0))
            var k_scales = Array[ScalePtr, JB](fill=walk.k_scale(j0))
            comptime for t in range(JB):
                k_block[t] = walk.k_row(j0 + t)
                k_later[t] = walk.k_ahead(j0 + AHEAD + t)
                comptime if quantized:
                    k_scales[t] = walk.k_scale(j0 + t)
            for h in range(n_kv):
                var k = _offset_rows(k_block, h * d)
                var k_next = _offset_rows(k_later, h * d)
                for g0 in range(0, padded, GB):
                    var base = h * padded + g0
                    var q_g = q.unsafe_offset(base * d)
                    var dots = Array[Vec, GB * JB](fill=Vec(0))
                    var i = 0
                    for granule in range(granules):
                        var scale = Array[Vec, JB](fill=Vec(1))
                        comptime if quantized and PER_VECTOR:
                            comptime for t in range(JB):
                                var s = k_scales[t][unsafe_offset=h * granules + granule]
                                scale[t] = Vec(s * unit)
                        while i < (granule + 1) * granularity:
                            comptime for t in range(JB):
                                prefetch(k_next[t].unsafe_offset(i))
                            comptime for t in range(JB):
                                var key = widen(k[t].unsafe_load[width=W](i))
                                comptime if quantized and PER_VECTOR:
                                    key *= scale[t]
                                comptime for g in range(GB):
                                    var qv = q_g.unsafe_load[width=W](g * d + i)
                                    dots[t * GB + g] = qv.fma(key, dots[t * GB + g])
                            i += W
                    comptime for first_dot in range(0, GB * JB, W):  # W dot products per reduction
                        comptime COUNT = min(W, GB * JB - first_dot)
                        var part = Array[Vec, COUNT](fill=Vec(0))
                        comptime for k in range(COUNT):
                            part[k] = dots[first_dot + k]
                        var sums = _lane_sums(part)
                        comptime if GB > 1 and GB & (GB - 1) == 0:
                            # A token's GB scores are adjacent lanes: one store for them.
                            comptime for k in range(0, COUNT, GB):
                                comptime t = (first_dot + k) // GB
                                var scores = sums.slice[GB, offset=k]()
                                comptime if quantized and not PER_VECTOR:
                                    scores *= k_scales[t][unsafe_offset=h] * unit
                                state.column(j0 + t).unsafe_store(base, scores)
                        else:
                            comptime for k in range(COUNT):
                                comptime t = (first_dot + k) // GB
                                comptime g = (first_dot + k) % GB
                                var score = sums[k]
                                comptime if quantized and not PER_VECTOR:
                                    score *= k_scales[t][unsafe_offset=h] * unit
                                state.column(j0 + t)[unsafe_offset=base + g] = score
        state.update(n)
        for j in range(n, _round_up(n, JB)):  # padding tokens of the last block weigh nothing
            for r in range(0, rows, W):
                state.column(j).unsafe_store(r, Vec(0))

        for j0 in range(0, n, JB):
            var v_block = RowBlock[cache_t.dtype, JB](fill=walk.v_row(j0))
            var v_later = RowBlock[cache_t.dtype, JB](fill=walk.v_row(j0))
            var v_scales = Array[ScalePtr, JB](fill=walk.v_scale(j0))
            comptime for t in range(JB):
                v_block[t] = walk.v_row(j0 + t)
                v_later[t] = walk.v_ahead(j0 + AHEAD + t)
                comptime if quantized:
                    v_scales[t] = walk.v_scale(j0 + t)
            for h in range(n_kv):
                var v = _offset_rows(v_block, h * d)
                var v_next = _offset_rows(v_later, h * d)
                for g0 in range(0, padded, GB):
                    var base = h * padded + g0
                    var probs = Array[Vec, GB * JB](fill=Vec(0))
                    comptime for t in range(JB):
                        var weight: Float32 = 1
                        comptime if quantized and not PER_VECTOR:
                            weight = v_scales[t][unsafe_offset=h] * unit
                        comptime for g in range(GB):
                            var p = state.column(j0 + t)[unsafe_offset=base + g]
                            probs[g * JB + t] = Vec(p * weight)
                    var i = 0
                    for granule in range(granules):
                        var scale = Array[Vec, JB](fill=Vec(1))
                        comptime if quantized and PER_VECTOR:
                            comptime for t in range(JB):
                                var s = v_scales[t][unsafe_offset=h * granules + granule]
                                scale[t] = Vec(s * unit)
                        while i < (granule + 1) * granularity:
                            comptime for t in range(JB):
                                prefetch(v_next[t].unsafe_offset(i))
                            # Loaded before any output is stored, which might alias them.
                            var vals = Array[Vec, JB](fill=Vec(0))
                            comptime for t in range(JB):
                                vals[t] = widen(v[t].unsafe_load[width=W](i))
                                comptime if quantized and PER_VECTOR:
                                    vals[t] *= scale[t]
                            comptime for g in range(GB):
                                var acc = state.acc_row(base + g).unsafe_offset(i)
                                var out = acc.unsafe_load[width=W](0)
                                comptime for t in range(JB):
                                    out = probs[g * JB + t].fma(vals[t], out)
                                acc.unsafe_store(0, out)
                            i += W

    for h in range(n_kv):
        for g in range(group):
            var r = h * padded + g
            var head = h * group + g
            if item.split < 0:
                queries.store_row(token, head, state.acc_row(r), 1 / state.row_sum[unsafe_offset=r])
            else:
                PartialState(partials.unsafe_offset(item.split), queries.n_q_heads, d).save(
                    head, state, r
                )
    _ = arena^


def _decode_any_group[
    q_dtype: DType, //, cache_t: KVCacheT
](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[q_dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    """Picks the query-head block that wastes the fewest padded rows for the
    GQA ratio (ratios above 8 run in blocks of 8), and for a quantized cache
    with several scales per head row the variant that scales every vector."""
    comptime if is_quantized[cache_t.dtype]():
        if k_cache.scales().granules > 1:
            _decode_group[True](k_cache, v_cache, queries, item, partials)
            return
    _decode_group[False](k_cache, v_cache, queries, item, partials)


def _decode_group[
    q_dtype: DType, //, PER_VECTOR: Bool, cache_t: KVCacheT
](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[q_dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    if queries.group == 1:
        _decode_item[cache_t, 1, PER_VECTOR](k_cache, v_cache, queries, item, partials)
    elif queries.group == 2:
        _decode_item[cache_t, 2, PER_VECTOR](k_cache, v_cache, queries, item, partials)
    elif queries.group == 3:
        _decode_item[cache_t, 3, PER_VECTOR](k_cache, v_cache, queries, item, partials)
    elif queries.group == 4:
        _decode_item[cache_t, 4, PER_VECTOR](k_cache, v_cache, queries, item, partials)
    else:
        _decode_item[cache_t, 8, PER_VECTOR](k_cache, v_cache, queries, item, partials)

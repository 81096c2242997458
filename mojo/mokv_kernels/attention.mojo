"""Flash attention of a ragged batch over the cache (CPU).

Token i of batch row b sits at position `cache_lengths[b] + i` and attends to
positions `0 ..= cache_lengths[b] + i` of its own sequence (with a sliding
window W > 0, only the last W of them); its own key and value were stored
before the op runs. Query head h reads KV head `h // (n_q_heads // n_kv_heads)`.

The score matrix is never materialised: context tokens are visited in tiles of
`TILE`, and every query row keeps an online softmax (running max `m`, running
sum `l`, unnormalised output `acc`), all in float32 whatever the storage dtype.
Scores are kept in base 2: queries are pre-multiplied by `scale * log2(e)`.

Scores of a tile are stored token-major (`[TILE, rows]`), so the softmax
bookkeeping runs across query rows in full vectors. Two kinds of work item
share this tile loop (`TileWalk`), reading pages in place:

- decode rows (one new token) walk each context token's whole
  `[n_kv_heads, head_dim]` row in memory order, with all query heads of a KV
  head updated per loaded key/value vector (GQA reuse). Decode is bound by
  memory traffic, and this is the access pattern that streams.
- prefill rows (several new tokens) are cut into blocks of query tokens per KV
  head. Queries are transposed once per item, so both products are
  register-blocked broadcast-FMA loops with no horizontal sums; each tile's
  head segment of K and V is copied (as float32) into scratch whose rows,
  unlike the cache's, do not all share a few L1 sets.

An item of either kind that holds more than its share of the batch's work is
split over its context (split-K); the partial softmax states are merged
afterwards, so a few long decode rows, or a short chunk on a long prefix,
still keep every core busy.

CPU only: the ops assert `is_cpu[target]()`.
"""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level
from std.math import ceildiv, exp2
from std.sys import prefetch, simd_width_of, size_of
from std.utils.numerics import neg_inf

from .bind import (
    check_layer,
    check_row_offsets,
    check_token_range,
    continuous_collection,
    paged_collection,
)
from .cache import CachePtr, KVCacheT, KVCollectionT, U32Ptr

comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime W = simd_width_of[DType.float32]()
"""Float32 lanes per vector: head_dim must be a multiple of it."""
comptime Vec = SIMD[DType.float32, W]
comptime TILE = 32
"""Context tokens per tile."""
comptime QK_VECS = 4 if W >= 16 else 2
"""Vectors of query rows per register block of the prefill score product."""
comptime QK_TOKENS = 4
"""Context tokens per register block of the prefill score product."""
comptime PV_ROWS = 4
"""Query rows per register block of the prefill value product."""
comptime PV_VECS = 4 if W >= 16 else 2
"""Vectors of head_dim per register block of the prefill value product."""
comptime PREFILL_ROWS = 128
"""Target query rows (tokens x heads of one KV head) per prefill item; a
multiple of `QK_VECS * W`."""
comptime SKEW = 16
"""Floats added to the row stride of scratch matrices. Power-of-two strides
(128 floats = 512 B) put a tile's rows into a few L1 sets, where they evict one
another between register blocks; one more cache line per row spreads them."""
comptime MIN_SPLIT = 512
"""Fewest context tokens worth a split of their own."""
comptime SPLITS_PER_WORKER = 4
comptime LOG2E: Float32 = 1.4426950408889634
comptime NEG_INF = neg_inf[DType.float32]()


struct Arena(Movable):
    """Float32 scratch of one work item, carved into zero-filled pieces. A
    List underneath, so it frees itself; pieces must not outlive it."""

    var storage: List[Float32]
    var used: Int

    def __init__(out self, capacity: Int):
        self.storage = List[Float32](length=capacity, fill=0)
        self.used = 0

    def take(mut self, count: Int, fill: Float32 = 0) -> F32Ptr:
        var p = self.storage.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_offset(self.used)
        for i in range(count):
            p[unsafe_offset=i] = fill
        self.used += count
        return p


def _round_up(n: Int, multiple: Int) -> Int:
    return ceildiv(n, multiple) * multiple


@fieldwise_init
struct RaggedQueries[dtype: DType](TrivialRegisterPassable):
    """The step's queries `[tokens, n_q_heads, head_dim]`, where their outputs
    go, and the attention parameters."""

    var q: CachePtr[Self.dtype]
    var out: CachePtr[Self.dtype]
    var row_offsets: U32Ptr
    var n_q_heads: Int
    var group: Int
    var head_dim: Int
    var scale_log2: Float32
    var window: Int

    def token(self, row: Int, index: Int) -> Int:
        """Index into `q`/`out` of new token `index` of batch row `row`."""
        return Int(self.row_offsets[unsafe_offset=row]) + index

    def visible_start(self, position: Int) -> Int:
        """First position that the token at `position` attends to."""
        if self.window > 0:
            return max(0, position + 1 - self.window)
        return 0

    def load_rows(
        self, dest: F32Ptr, token: Int, first_head: Int, count: Int
    ):
        """Copies `count` query heads from `first_head` on of `token` to
        `dest` as float32, scaled into base-2 score units."""
        var src = self.q.unsafe_offset(
            (token * self.n_q_heads + first_head) * self.head_dim
        )
        for i in range(0, count * self.head_dim, W):
            dest.unsafe_store(
                i, src.unsafe_load[width=W](i).cast[DType.float32]() * self.scale_log2
            )

    def store_row(self, token: Int, head: Int, acc: F32Ptr, inv_sum: Float32):
        """Writes `acc * inv_sum` as the output of query head `head`."""
        var dst = self.out.unsafe_offset(
            (token * self.n_q_heads + head) * self.head_dim
        )
        for i in range(0, self.head_dim, W):
            dst.unsafe_store(i, (acc.unsafe_load[width=W](i) * inv_sum).cast[Self.dtype]())


@fieldwise_init
struct WorkItem(TrivialRegisterPassable):
    """New tokens `first_token ..< first_token + num_tokens` of batch row `row`
    against context positions `ctx_start ..< ctx_end`.

    `kv_head` is -1 for a decode item (every head); `split` is -1 when the item
    covers the whole context and writes the output, else the offset of its
    `PartialState` in the partials buffer, merged by `_merge_splits`."""

    var row: Int
    var first_token: Int
    var num_tokens: Int
    var kv_head: Int
    var ctx_start: Int
    var ctx_end: Int
    var split: Int


@fieldwise_init
struct SplitGroup(TrivialRegisterPassable):
    """Output rows whose context was split over `count` items: query heads
    `first_head ..< first_head + num_heads` of new tokens `first_token ..<
    first_token + num_tokens` of batch row `row`, with the items' partial
    states one after another from offset `first_state` on."""

    var row: Int
    var first_token: Int
    var num_tokens: Int
    var first_head: Int
    var num_heads: Int
    var first_state: Int
    var count: Int

    def rows(self) -> Int:
        """Output rows, token-major: row `t * num_heads + g` is head
        `first_head + g` of token `first_token + t`."""
        return self.num_tokens * self.num_heads

    def state(self, partials: F32Ptr, split: Int, head_dim: Int) -> PartialState:
        """The partial state of split `split < count`."""
        var floats = PartialState.floats(self.rows(), head_dim)
        return PartialState(partials.unsafe_offset(self.first_state + split * floats), self.rows(), head_dim)


struct PartialState(TrivialRegisterPassable):
    """A split item's softmax state in the shared partials buffer, for `rows`
    output rows: `acc [rows, head_dim]`, then `row_max [rows]`, `row_sum [rows]`."""

    var base: F32Ptr
    var rows: Int
    var head_dim: Int

    def __init__(out self, base: F32Ptr, rows: Int, head_dim: Int):
        self.base = base
        self.rows = rows
        self.head_dim = head_dim

    @staticmethod
    def floats(rows: Int, head_dim: Int) -> Int:
        return rows * (head_dim + 2)

    def acc(self, r: Int) -> F32Ptr:
        return self.base.unsafe_offset(r * self.head_dim)

    def row_max(self) -> F32Ptr:
        return self.base.unsafe_offset(self.rows * self.head_dim)

    def row_sum(self) -> F32Ptr:
        return self.base.unsafe_offset(self.rows * (self.head_dim + 1))

    def save(self, r: Int, state: SoftmaxState, state_row: Int):
        """Copies row `state_row` of an item's softmax state to row `r`."""
        self.row_max()[unsafe_offset=r] = state.row_max[unsafe_offset=state_row]
        self.row_sum()[unsafe_offset=r] = state.row_sum[unsafe_offset=state_row]
        var dst = self.acc(r)
        var src = state.acc_row(state_row)
        for i in range(0, self.head_dim, W):
            dst.unsafe_store(i, src.unsafe_load[width=W](i))


@fieldwise_init
struct SoftmaxState(TrivialRegisterPassable):
    """Online-softmax state of `rows` query rows (a multiple of `W`): the
    current tile's scores, token-major `[TILE, rows]` so that the softmax runs
    across rows in full vectors (and turns them into probabilities in place),
    the running max and sum per row, and the unnormalised output
    `[rows, head_dim]`. Score columns lie `rows + SKEW` floats apart."""

    var scores: F32Ptr
    var row_max: F32Ptr
    var row_sum: F32Ptr
    var alpha: F32Ptr
    var acc: F32Ptr
    var rows: Int
    var head_dim: Int

    @staticmethod
    def floats(rows: Int, head_dim: Int) -> Int:
        """Scratch floats that `take` carves out of an arena."""
        return (rows + SKEW) * TILE + rows * (3 + head_dim)

    @staticmethod
    def take(mut arena: Arena, rows: Int, head_dim: Int) -> Self:
        var scores = arena.take((rows + SKEW) * TILE)
        var row_max = arena.take(rows, NEG_INF)
        var row_sum = arena.take(rows)
        var alpha = arena.take(rows)
        return Self(scores, row_max, row_sum, alpha, arena.take(rows * head_dim), rows, head_dim)

    def column(self, j: Int) -> F32Ptr:
        """Scores (then probabilities) of tile token `j`, one per row."""
        return self.scores.unsafe_offset(j * (self.rows + SKEW))

    def acc_row(self, r: Int) -> F32Ptr:
        return self.acc.unsafe_offset(r * self.head_dim)

    def update(self, n: Int):
        """Folds the scores of tile tokens `0 ..< n` into the running state,
        leaving their probabilities (relative to the new max) in place, and
        rescales the outputs of rows whose max moved."""
        for r in range(0, self.rows, W):
            var tile_max = Vec(NEG_INF)
            for j in range(n):
                tile_max = max(tile_max, self.column(j).unsafe_load[width=W](r))
            var old_max = self.row_max.unsafe_load[width=W](r)
            var new_max = max(old_max, tile_max)
            # A row that has seen nothing yet keeps max -inf: subtract 0 so
            # its probabilities come out exp2(-inf) = 0 rather than NaN.
            var shift = new_max.eq(Vec(NEG_INF)).select(Vec(0), new_max)
            var total = Vec(0)
            for j in range(n):
                var p = exp2(self.column(j).unsafe_load[width=W](r) - shift)
                self.column(j).unsafe_store(r, p)
                total += p
            var alpha = exp2(old_max - shift)
            self.row_sum.unsafe_store(r, self.row_sum.unsafe_load[width=W](r) * alpha + total)
            self.row_max.unsafe_store(r, new_max)
            self.alpha.unsafe_store(r, alpha)
        for r in range(self.rows):
            var alpha = self.alpha[unsafe_offset=r]
            if alpha != 1:
                var acc = self.acc_row(r)
                for i in range(0, self.head_dim, W):
                    acc.unsafe_store(i, acc.unsafe_load[width=W](i) * alpha)


comptime RowPtrs[dtype: DType] = Array[CachePtr[dtype], TILE]
comptime RowBlock[dtype: DType, size: Int] = Array[CachePtr[dtype], size]


def _offset_rows[dtype: DType, size: Int](rows: RowBlock[dtype, size], offset: Int) -> RowBlock[dtype, size]:
    """The same rows, each `offset` elements on: one head's segment of each."""
    var out = RowBlock[dtype, size](fill=rows[0])
    comptime for t in range(size):
        out[t] = rows[t].unsafe_offset(offset)
    return out^


def _tile_rows[cache_t: KVCacheT](
    cache: cache_t,
    row: Int,
    start: Int,
    count: Int,
    rows: Pointer[CachePtr[cache_t.dtype], MutUntrackedOrigin],
):
    """Writes pointers to the token rows `start ..< start + count` of batch
    row `row` to `rows`, one page lookup per contiguous run."""
    var row_elems = cache.num_heads() * cache.head_dim()
    var j = 0
    while j < count:
        var run = min(count - j, cache.contiguous_tokens(start + j))
        var p = cache.row_ptr(row, start + j)
        for i in range(run):
            rows[unsafe_offset=j + i] = p.unsafe_offset(i * row_elems)
        j += run


struct TileWalk[cache_t: KVCacheT]:
    """Walks context positions `start ..< end` of batch row `row` tile by
    tile, holding the K and V row pointers of the current tile (`pos`, `n`)
    and already those of the next (`next_n` rows).

    A prefill item reads one head's segment of each row: pieces a row apart
    (4 KB for 8 heads of 128 floats) that the hardware prefetcher does not
    follow, so the item prefetches the next tile's segments with
    `prefetch_next`, a row at a time spread over its compute (issued all at
    once, the prefetches themselves stall on the line fill buffers).
    Decode items read whole rows in blocks of a few, and prefetch the rows a
    fixed distance ahead (`k_ahead`, `v_ahead`) as they go: a block ahead is
    too close to hide the memory latency."""

    var k_cache: Self.cache_t
    var v_cache: Self.cache_t
    var row: Int
    var end: Int
    var pos: Int
    var n: Int
    var next_n: Int
    var k_rows: RowPtrs[Self.cache_t.dtype]
    var v_rows: RowPtrs[Self.cache_t.dtype]
    var next_k: RowPtrs[Self.cache_t.dtype]
    var next_v: RowPtrs[Self.cache_t.dtype]

    def __init__(
        out self,
        k_cache: Self.cache_t,
        v_cache: Self.cache_t,
        row: Int,
        start: Int,
        end: Int,
    ):
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.row = row
        self.end = end
        self.pos = start
        self.n = 0
        self.next_n = 0
        var any_row = k_cache.row_ptr(row, start)
        self.k_rows = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self.v_rows = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self.next_k = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self.next_v = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self._fetch(start)

    def _fetch(mut self, start: Int):
        """Looks up the rows of the tile at `start`, if any."""
        self.next_n = max(0, min(TILE, self.end - start))
        if self.next_n > 0:
            _tile_rows(
                self.k_cache, self.row, start, self.next_n,
                self.next_k.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            )
            _tile_rows(
                self.v_cache, self.row, start, self.next_n,
                self.next_v.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            )

    def prefetch_next(self, j: Int, start: Int, length: Int):
        """Prefetches elements `start ..< start + length` of the K and V rows
        `j` of the next tile, if it has one."""
        if j >= self.next_n:
            return
        comptime line = 64 // size_of[Scalar[Self.cache_t.dtype]]()
        var k = self.next_k[j].unsafe_offset(start)
        var v = self.next_v[j].unsafe_offset(start)
        for i in range(0, length, line):
            prefetch(k.unsafe_offset(i))
            prefetch(v.unsafe_offset(i))

    def k_row(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Key row `j < TILE` of the current tile, unchecked: a checked index
        makes LLVM keep an abort path's arguments alive in the hot loop."""
        return self.k_rows.unsafe_ptr()[unsafe_offset=j]

    def v_row(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Value row `j < TILE` of the current tile, unchecked."""
        return self.v_rows.unsafe_ptr()[unsafe_offset=j]

    def k_ahead(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Key row `j` counted from the current tile's start, reaching into
        the next tile (the last row once past both): a prefetch target."""
        if j < self.n:
            return self.k_row(j)
        if j - self.n < self.next_n:
            return self.next_k.unsafe_ptr()[unsafe_offset=j - self.n]
        return self.k_row(self.n - 1)

    def v_ahead(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Value row `j` as `k_ahead` finds key rows."""
        if j < self.n:
            return self.v_row(j)
        if j - self.n < self.next_n:
            return self.next_v.unsafe_ptr()[unsafe_offset=j - self.n]
        return self.v_row(self.n - 1)

    def advance(mut self) -> Bool:
        """Moves to the next tile; False once the context is exhausted."""
        self.pos += self.n
        if self.pos >= self.end:
            return False
        self.n = min(TILE, self.end - self.pos)
        self.k_rows = self.next_k.copy()
        self.v_rows = self.next_v.copy()
        for j in range(self.n, TILE):  # blocks may run past a partial tile's end
            self.k_rows[j] = self.k_rows[self.n - 1]
            self.v_rows[j] = self.v_rows[self.n - 1]
        self._fetch(self.pos + self.n)
        return True


# ===----------------------------------------------------------------------=== #
# Decode: one new token, rows walked in place
# ===----------------------------------------------------------------------=== #


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


def _decode_item[cache_t: KVCacheT, GB: Int](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[cache_t.dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    """Runs a decode item. Query heads of a KV head are processed `GB` at a
    time (padded with zero rows up to a multiple of `GB`) against `JB` context
    tokens at a time, so every loaded key or value vector feeds `GB` FMAs and
    every output vector stays in a register across `JB` tokens. bfloat16
    rows are widened vector by vector as they are loaded."""
    comptime JB = _decode_tokens(GB)
    comptime AHEAD = 8  # tokens between the rows read and the rows prefetched
    var n_kv = k_cache.num_heads()
    var d = queries.head_dim
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
            comptime for t in range(JB):
                k_block[t] = walk.k_row(j0 + t)
                k_later[t] = walk.k_ahead(j0 + AHEAD + t)
            for h in range(n_kv):
                var k = _offset_rows(k_block, h * d)
                var k_next = _offset_rows(k_later, h * d)
                for g0 in range(0, padded, GB):
                    var base = h * padded + g0
                    var q_g = q.unsafe_offset(base * d)
                    var dots = Array[Vec, GB * JB](fill=Vec(0))
                    var i = 0
                    while i < d:
                        comptime for t in range(JB):
                            prefetch(k_next[t].unsafe_offset(i))
                        comptime for t in range(JB):
                            var key = k[t].unsafe_load[width=W](i).cast[DType.float32]()
                            comptime for g in range(GB):
                                var qv = q_g.unsafe_load[width=W](g * d + i)
                                dots[g * JB + t] = qv.fma(key, dots[g * JB + t])
                        i += W
                    comptime for first_dot in range(0, GB * JB, W):  # W dot products per reduction
                        comptime COUNT = min(W, GB * JB - first_dot)
                        var part = Array[Vec, COUNT](fill=Vec(0))
                        comptime for k in range(COUNT):
                            part[k] = dots[first_dot + k]
                        var sums = _lane_sums(part)
                        comptime for k in range(COUNT):
                            comptime g = (first_dot + k) // JB
                            comptime t = (first_dot + k) % JB
                            state.column(j0 + t)[unsafe_offset=base + g] = sums[k]
        state.update(n)
        for j in range(n, _round_up(n, JB)):  # padding tokens of the last block weigh nothing
            for r in range(0, rows, W):
                state.column(j).unsafe_store(r, Vec(0))

        for j0 in range(0, n, JB):
            var v_block = RowBlock[cache_t.dtype, JB](fill=walk.v_row(j0))
            var v_later = RowBlock[cache_t.dtype, JB](fill=walk.v_row(j0))
            comptime for t in range(JB):
                v_block[t] = walk.v_row(j0 + t)
                v_later[t] = walk.v_ahead(j0 + AHEAD + t)
            for h in range(n_kv):
                var v = _offset_rows(v_block, h * d)
                var v_next = _offset_rows(v_later, h * d)
                for g0 in range(0, padded, GB):
                    var base = h * padded + g0
                    var probs = Array[Vec, GB * JB](fill=Vec(0))
                    comptime for t in range(JB):
                        comptime for g in range(GB):
                            probs[g * JB + t] = Vec(state.column(j0 + t)[unsafe_offset=base + g])
                    var i = 0
                    while i < d:
                        comptime for t in range(JB):
                            prefetch(v_next[t].unsafe_offset(i))
                        # Loaded before any output is stored, which might alias them.
                        var vals = Array[Vec, JB](fill=Vec(0))
                        comptime for t in range(JB):
                            vals[t] = v[t].unsafe_load[width=W](i).cast[DType.float32]()
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
                PartialState(partials.unsafe_offset(item.split), queries.n_q_heads, d).save(head, state, r)
    _ = arena^


# ===----------------------------------------------------------------------=== #
# Prefill: blocks of new tokens per KV head
# ===----------------------------------------------------------------------=== #


def _qk_block(
    q_t: F32Ptr, q_stride: Int, keys: F32Ptr, key_stride: Int, j0: Int, state: SoftmaxState, r0: Int, head_dim: Int
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


def _pv_block[NV: Int](
    state: SoftmaxState, r0: Int, values: F32Ptr, value_stride: Int, col: Int, n: Int
):
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


def _stage_tile[dtype: DType](
    rows: RowPtrs[dtype], offset: Int, n: Int, head_dim: Int, staging: F32Ptr, stride: Int
):
    """Copies one head (`offset ..< offset + head_dim`) of the tile's first
    `n` rows into `staging` (`TILE` rows `stride` floats apart) as float32.
    Copied even for float32 storage: cache rows of 8 heads x 128 floats lie
    4 KB apart, so a tile's segments would all fall into the same L1 sets and
    evict each other between register blocks. Rows past `n` keep an earlier
    tile's values (or zeros): score blocks that run over the end of a partial
    tile compute columns that the softmax never reads."""
    for j in range(n):
        var src = rows[j].unsafe_offset(offset)
        var dst = staging.unsafe_offset(j * stride)
        for i in range(0, head_dim, W):
            dst.unsafe_store(i, src.unsafe_load[width=W](i).cast[DType.float32]())


def _prefill_item[cache_t: KVCacheT](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[cache_t.dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    """Runs a prefill item: query rows are (token, head of the KV head's
    group) pairs, token-major, padded with zero rows to the register blocks;
    masks apply only to tiles on the causal diagonal or the window's edge."""
    var d = queries.head_dim
    var group = queries.group
    var h = item.kv_head
    var rows = item.num_tokens * group
    var padded = _round_up(rows, QK_VECS * W)
    var first_position = k_cache.cache_length(item.row) + item.first_token

    var q_stride = padded + SKEW
    var tile_stride = d + SKEW  # of the staged K and V tiles
    var arena = Arena(d * (q_stride + group) + SoftmaxState.floats(padded, d) + 2 * TILE * tile_stride)
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
        _stage_tile(walk.k_rows, h * d, n, d, k_staging, tile_stride)
        _stage_tile(walk.v_rows, h * d, n, d, v_staging, tile_stride)
        for r0 in range(0, padded, QK_VECS * W):
            for j0 in range(0, n, QK_TOKENS):
                _qk_block(q_t, q_stride, k_staging, tile_stride, j0, state, r0, d)
        if pos < all_see_from or pos + n > first_position + 1:
            for j in range(n):
                var p = SIMD[DType.int32, W](Int32(pos + j))
                var column = state.column(j)
                for r in range(0, padded, W):
                    var seen = p.ge(lo.unsafe_load[width=W](r)) & p.lt(hi.unsafe_load[width=W](r))
                    column.unsafe_store(r, seen.select(column.unsafe_load[width=W](r), Vec(NEG_INF)))
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
                queries.store_row(token, h * group + g, state.acc_row(r), 1 / state.row_sum[unsafe_offset=r])
            else:
                PartialState(partials.unsafe_offset(item.split), rows, d).save(r, state, r)
    _ = bounds^
    _ = arena^


# ===----------------------------------------------------------------------=== #
# Split-K: merging the partial states of a split context
# ===----------------------------------------------------------------------=== #


def _merge_splits[dtype: DType](
    queries: RaggedQueries[dtype], group: SplitGroup, partials: F32Ptr
):
    """Combines the partial softmax states of a split group and writes its
    outputs: each split's sum and output are rescaled to the global max. A
    split that saw none of a row's positions holds max -inf and weighs 0."""
    var d = queries.head_dim
    var arena = Arena(d)
    var acc = arena.take(d)
    for r in range(group.rows()):
        var global_max = NEG_INF
        for s in range(group.count):
            global_max = max(global_max, group.state(partials, s, d).row_max()[unsafe_offset=r])
        var total: Float32 = 0
        for i in range(0, d, W):
            acc.unsafe_store(i, Vec(0))
        for s in range(group.count):
            var state = group.state(partials, s, d)
            var weight = exp2(state.row_max()[unsafe_offset=r] - global_max)
            total += state.row_sum()[unsafe_offset=r] * weight
            var src = state.acc(r)
            for i in range(0, d, W):
                acc.unsafe_store(i, acc.unsafe_load[width=W](i) + src.unsafe_load[width=W](i) * weight)
        var token = queries.token(group.row, group.first_token + r // group.num_heads)
        queries.store_row(token, group.first_head + r % group.num_heads, acc, 1 / total)
    _ = arena^


# ===----------------------------------------------------------------------=== #
# Planning and the ops
# ===----------------------------------------------------------------------=== #


def _decode_any_group[cache_t: KVCacheT](
    k_cache: cache_t,
    v_cache: cache_t,
    queries: RaggedQueries[cache_t.dtype],
    item: WorkItem,
    partials: F32Ptr,
):
    """Picks the query-head block that wastes the fewest padded rows for the
    GQA ratio (ratios above 8 run in blocks of 8)."""
    if queries.group == 1:
        _decode_item[cache_t, 1](k_cache, v_cache, queries, item, partials)
    elif queries.group == 2:
        _decode_item[cache_t, 2](k_cache, v_cache, queries, item, partials)
    elif queries.group == 3:
        _decode_item[cache_t, 3](k_cache, v_cache, queries, item, partials)
    elif queries.group == 4:
        _decode_item[cache_t, 4](k_cache, v_cache, queries, item, partials)
    else:
        _decode_item[cache_t, 8](k_cache, v_cache, queries, item, partials)


def _output_heads(item: WorkItem, n_q_heads: Int, group: Int) -> Tuple[Int, Int]:
    """First query head and number of heads that `item` computes per token."""
    if item.kv_head < 0:
        return (0, n_q_heads)
    return (item.kv_head * group, group)


def _plan[cache_t: KVCacheT](
    cache: cache_t,
    queries: RaggedQueries[cache_t.dtype],
    batch: Int,
    workers: Int,
    mut items: List[WorkItem],
    mut groups: List[SplitGroup],
) -> Int:
    """Cuts the batch into work items and returns the floats of partial state
    that the split ones need.

    Prefill rows are cut into blocks of new tokens per KV head (first: they
    are the largest), decode rows make one item each. An item holding more
    than an even share of the batch's work (query rows x context tokens, over
    `SPLITS_PER_WORKER` items per worker) is then split over its context
    (split-K) into pieces of at least `MIN_SPLIT` tokens, so a few long
    sequences, or a short chunk on a long prefix, still keep every core busy."""
    # Whole tokens per block without spilling into another register block of rows.
    var max_block_tokens = max(1, PREFILL_ROWS // queries.group)
    var whole = List[WorkItem]()
    var decode = List[WorkItem]()
    for b in range(batch):
        var new_tokens = queries.token(b + 1, 0) - queries.token(b, 0)
        var cache_length = cache.cache_length(b)
        if new_tokens == 1:
            decode.append(WorkItem(b, 0, 1, -1, queries.visible_start(cache_length), cache_length + 1, -1))
        elif new_tokens > 1:
            # Blocks of even size: a short remainder block would leave a core idle.
            var block_tokens = ceildiv(new_tokens, ceildiv(new_tokens, max_block_tokens))
            for t0 in range(0, new_tokens, block_tokens):
                var count = min(block_tokens, new_tokens - t0)
                var start = queries.visible_start(cache_length + t0)
                for h in range(cache.num_heads()):
                    whole.append(WorkItem(b, t0, count, h, start, cache_length + t0 + count, -1))
    whole.extend(decode^)

    var total_work = 0
    for item in whole:
        var heads = _output_heads(item, queries.n_q_heads, queries.group)
        total_work += item.num_tokens * heads[1] * (item.ctx_end - item.ctx_start)
    var share = max(1, ceildiv(total_work, workers * SPLITS_PER_WORKER))
    var partial_floats = 0
    for item in whole:
        var heads = _output_heads(item, queries.n_q_heads, queries.group)
        var length = item.ctx_end - item.ctx_start
        var pieces = min(ceildiv(item.num_tokens * heads[1] * length, share), ceildiv(length, MIN_SPLIT))
        if pieces <= 1:
            items.append(item)
            continue
        var chunk = ceildiv(length, pieces)
        var group = SplitGroup(
            item.row, item.first_token, item.num_tokens, heads[0], heads[1], partial_floats, ceildiv(length, chunk)
        )
        var state_floats = PartialState.floats(group.rows(), queries.head_dim)
        for s in range(group.count):
            var first = item.ctx_start + s * chunk
            items.append(
                WorkItem(
                    item.row, item.first_token, item.num_tokens, item.kv_head,
                    first, min(item.ctx_end, first + chunk), partial_floats + s * state_floats,
                )
            )
        partial_floats += group.count * state_floats
        groups.append(group)
    return partial_floats


def attention_over[collection_t: KVCollectionT](
    collection: collection_t,
    output: OutputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    q: InputTensor[dtype=collection_t.CacheType.dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    layer_idx: UInt32,
    scale: Float32,
    sliding_window: UInt32,
) raises:
    """Checks every input against the cache, then runs the batch's work
    items in parallel and merges the split ones."""
    comptime dtype = collection_t.CacheType.dtype
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
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
    if d % W != 0:
        raise Error(t"head_dim {d} is not a multiple of {W} (the float32 SIMD width)")
    check_row_offsets(row_offsets, batch, q.dim_size(0))

    var queries = RaggedQueries[dtype](
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
        if new_tokens > 0:
            var cache_length = k_cache.cache_length(b)
            check_token_range(
                k_cache, b, queries.visible_start(cache_length), cache_length + new_tokens
            )

    var items = List[WorkItem]()
    var groups = List[SplitGroup]()
    var partial_floats = _plan(k_cache, queries, batch, parallelism_level(None), items, groups)
    var partials_arena = Arena(partial_floats)
    var partials = partials_arena.take(partial_floats)
    var item_list = items.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var group_list = groups.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    def run_item(i: Int) {var k_cache, var v_cache, var queries, var item_list, var partials}:
        var item = item_list[unsafe_offset=i]
        if item.kv_head >= 0:
            _prefill_item(k_cache, v_cache, queries, item, partials)
        else:
            _decode_any_group(k_cache, v_cache, queries, item, partials)

    def merge_group(i: Int) {var queries, var group_list, var partials}:
        _merge_splits(queries, group_list[unsafe_offset=i], partials)

    sync_parallelize(run_item, len(items))
    sync_parallelize(merge_group, len(groups))
    _ = partials_arena^
    _ = items^
    _ = groups^


@extensibility.register("mokv.attention.paged")
struct AttentionPaged:
    """Flash attention of a ragged batch over one layer of a paged cache."""

    @staticmethod
    def execute[dtype: DType, target: StaticString](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        blocks: _MutableInputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, ...],
        q: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        sliding_window: UInt32,
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "mokv's attention op runs on CPU only"
        var collection = paged_collection(blocks, cache_lengths, lookup_table)
        attention_over(
            collection, output, q, input_row_offsets, layer_idx, scale,
            sliding_window,
        )


@extensibility.register("mokv.attention.continuous")
struct AttentionContinuous:
    """Flash attention of a ragged batch over one layer of a
    continuous-batching cache."""

    @staticmethod
    def execute[dtype: DType, target: StaticString](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        blocks: _MutableInputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=1, ...],
        q: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        sliding_window: UInt32,
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "mokv's attention op runs on CPU only"
        var collection = continuous_collection(blocks, cache_lengths, lookup_table)
        attention_over(
            collection, output, q, input_row_offsets, layer_idx, scale,
            sliding_window,
        )


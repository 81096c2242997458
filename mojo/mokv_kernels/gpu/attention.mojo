"""Flash attention of a ragged batch over the cache, on a GPU: the op's
entry point, the plan, the prefill tile kernel and the split-K merge.

Same semantics as the CPU op (see `..attention`): new token i of batch row b
sits at position `cache_lengths[b] + i` and attends to positions
`0 ..= cache_lengths[b] + i` of its own sequence (the last W with a sliding
window), query head h reading KV head `h // group`.

One thread block per (query tile, KV head, batch row, split)
(`attention_work`): its query rows are consecutive new tokens of the row
times the `group` query heads sharing the KV head, so every K/V element a
block loads serves the whole GQA group. Two kernels:

- decode (`decode`): up to `DECODE_ROWS` = 8 query rows, keys read straight
  into registers, one per thread, 128 per tile (flash decoding);
- prefill (`AttentionKernel` here): 64 query rows (32 for head_dim 256); K
  and V of each 32-key tile staged in shared memory as float32, each thread
  scoring a few rows against a few keys, and keeping its share of the output
  rows in registers.

Both go through the same online softmax (`tile_softmax`). Split-K: when the
grid would not cover the device, the context is cut into `splits` ranges,
each block writes its unnormalised state (output, max, sum) to scratch, and
`MergeKernel` combines them per (token, head).

The grid is sized on the host from the batch summary (`BatchBounds`: most
new tokens of a row, longest context) without reading device memory; each block reads its row's
offsets and cache length itself. Rows with more new tokens than the bound are
not fully covered: the bound must hold (the manager's `max_lengths` does).

Not yet here: tensor cores (Hopper's wgmma), bulk tensor copies,
double-buffered tiles; the products are float32 FMAs.
"""

from extensibility import InputTensor, OutputTensor
from std.math import ceildiv, exp2
from std.sys import size_of

from ..bind import check_layer
from ..cache.batch_summary import BatchSummary
from ..cache.traits import KVCacheT, KVCollectionT
from ..pointers import CachePtr
from .attention_work import (
    BLOCK_THREADS,
    DECODE_ROWS,
    LOG2E,
    NEG_INF,
    WARP,
    WARPS,
    AttentionArgs,
    BlockWork,
    block_work,
    split_state_offset,
    stage_queries,
    write_row_part,
)
from .block import (
    BlockExecutor,
    BlockId,
    F32Ptr,
    KernelT,
    Launcher,
    ThreadProgram,
)
from .decode import DecodeKernel
from .tile_softmax import TileSoftmax

comptime MIN_SPLIT_TOKENS = 256
"""Fewest context tokens worth a split of their own."""
comptime MAX_SPLITS = 64
comptime BLOCKS_PER_MULTIPROCESSOR = 2
"""Blocks per multiprocessor the grid aims for before splitting the context:
as many as fit at once (two: a decode block's 83 KB of shared memory and 178
registers per thread, sized by `decode.mojo`'s `TILE_PAIR_BYTES` and
`MIN_BLOCKS`, and a prefill block's 76 KB and 232 registers), so that a long
context is one wave of longer splits rather than two of shorter ones (H100:
batch 1 at 32k 0.72-0.73x MAX's kernel against 0.63-0.68x with 4;
tests/gpu/results/2026-11-26-h100-sixth)."""
# Phases of a prefill block (`AttentionThread.step`).
comptime LOAD_Q = 0
comptime LOAD_KV = 1
comptime SCORES = 2
comptime ROW_MAX = 3
comptime EXPONENTIATE = 4
comptime ACCUMULATE = 5
comptime FINISH = 6

# Phases of a merge block (`MergeThread.step`).
comptime MERGE_READ = 0
comptime MERGE_WEIGH = 1
comptime MERGE_COMBINE = 2


@fieldwise_init
struct BatchBounds(TrivialRegisterPassable):
    """Host-side upper bounds of a batch, which size the grid."""

    var max_new_tokens: Int
    var max_context: Int

    @staticmethod
    def of(summary: BatchSummary, total_tokens: Int, max_tokens: Int) -> Self:
        """The bounds that the batch summary states, capped by what the
        batch can hold: no row has more new tokens than the batch, nor a
        longer context than its lookup-table row addresses (or than its new
        tokens, when every cache is empty)."""
        var new_tokens = min(summary.max_new_tokens, total_tokens)
        var context = min(summary.max_context, max_tokens)
        if summary.max_cache_length == 0:
            context = min(context, new_tokens)
        return Self(new_tokens, max(context, new_tokens))


@fieldwise_init
struct AttentionPlan(TrivialRegisterPassable):
    """How a batch is cut into blocks."""

    var decode: Bool
    """Decode tile shape (`DECODE_ROWS` query rows) or prefill's."""
    var tokens_per_tile: Int
    var query_tiles: Int
    """Tiles per batch row: enough for the row with the most new tokens."""
    var splits: Int


def plan_attention(
    batch: Int,
    n_kv_heads: Int,
    group: Int,
    prefill_rows: Int,
    bounds: BatchBounds,
    multiprocessors: Int,
) -> AttentionPlan:
    """Picks the tile shape, then splits the context until the grid covers
    `BLOCKS_PER_MULTIPROCESSOR` blocks per multiprocessor (no split shorter
    than `MIN_SPLIT_TOKENS`)."""
    var max_new = max(bounds.max_new_tokens, 1)
    var decode = max_new * group <= DECODE_ROWS
    var tokens_per_tile = (DECODE_ROWS if decode else prefill_rows) // group
    var query_tiles = ceildiv(max_new, tokens_per_tile)
    var blocks = query_tiles * n_kv_heads * batch
    var wanted = BLOCKS_PER_MULTIPROCESSOR * multiprocessors
    var splits = 1
    if blocks < wanted:
        var by_context = max(1, bounds.max_context // MIN_SPLIT_TOKENS)
        splits = max(1, min(ceildiv(wanted, blocks), by_context, MAX_SPLITS))
    return AttentionPlan(decode, tokens_per_tile, query_tiles, splits)


struct SharedTiles[D: Int, BM: Int, BN: Int, LPR: Int](TrivialRegisterPassable):
    """The prefill block's shared memory, float32: queries `[BM, D + 1]`,
    keys `[BN, D + 1]` (rows padded by one word, so a warp reading one column
    of several rows hits distinct banks), values `[BN, D]`, then the online
    softmax's regions for `BM` rows."""

    comptime STRIDE = Self.D + 1
    comptime Q = 0
    comptime K = Self.Q + Self.BM * Self.STRIDE
    comptime V = Self.K + Self.BN * Self.STRIDE
    comptime SOFTMAX = Self.V + Self.BN * Self.D
    comptime FLOATS = Self.SOFTMAX + TileSoftmax[Self.BM, Self.BN, Self.LPR].FLOATS

    var base: F32Ptr

    def __init__(out self, base: F32Ptr):
        self.base = base

    def at(self, region: Int, index: Int) -> F32Ptr:
        return self.base.unsafe_offset(region + index)


struct AttentionThread[cache_t: KVCacheT, D: Int, BM: Int, BN: Int, SK: Int](ThreadProgram):
    """One thread of a prefill block.

    Thread layouts per phase:
    - scores: `KG = BN / SK` key groups by `RG` row groups; the thread scores
      rows `rg + RG * k` against keys `kg + KG * i`;
    - softmax: `LPR` threads per query row, each over `BN / LPR` keys;
    - values: warp w owns rows `w + WARPS * k`, lane c columns `c + 32 * i`
      (`acc`, the thread's registers across tiles)."""

    comptime dtype = Self.cache_t.dtype
    comptime KG = Self.BN // Self.SK
    comptime RG = BLOCK_THREADS // Self.KG
    comptime SR = Self.BM // Self.RG
    comptime LPR = BLOCK_THREADS // Self.BM
    comptime RPW = Self.BM // WARPS
    comptime CPL = Self.D // WARP
    comptime VEC = 16 // size_of[Scalar[Self.dtype]]()
    comptime UNITS = Self.BN * Self.D // Self.VEC // BLOCK_THREADS
    comptime Tiles = SharedTiles[Self.D, Self.BM, Self.BN, Self.LPR]
    comptime Softmax = TileSoftmax[Self.BM, Self.BN, Self.LPR]

    var args: AttentionArgs[Self.cache_t]
    var work: BlockWork
    var tid: Int
    var smem: Self.Tiles
    var acc: Array[Float32, Self.RPW * Self.CPL]

    def __init__(
        out self,
        args: AttentionArgs[Self.cache_t],
        work: BlockWork,
        tid: Int,
        shared: F32Ptr,
    ):
        comptime assert Self.D % WARP == 0, "head_dim must be a multiple of 32"
        comptime assert (
            BLOCK_THREADS % Self.KG == 0 and Self.BM % Self.RG == 0 and Self.SR >= 1
        ), "score layout"
        comptime assert BLOCK_THREADS % Self.BM == 0 and Self.BN % Self.LPR == 0, "softmax layout"
        comptime assert Self.BM % WARPS == 0, "value layout"
        comptime assert (Self.BN * Self.D // Self.VEC) % BLOCK_THREADS == 0, "tile load layout"
        self.args = args
        self.work = work
        self.tid = tid
        self.smem = Self.Tiles(shared)
        self.acc = Array[Float32, Self.RPW * Self.CPL](fill=0)

    def rows(self) -> Int:
        return self.work.rows(self.args.group)

    def softmax(self) -> Self.Softmax:
        return Self.Softmax(self.smem.at(Self.Tiles.SOFTMAX, 0))

    @always_inline
    def step(mut self, phase: Int, arg: Int):
        if phase == LOAD_Q:
            self.load_queries()
        elif phase == LOAD_KV:
            self.load_tile(arg)
        elif phase == SCORES:
            self.score_tile(arg)
        elif phase == ROW_MAX:
            self.softmax().partial_max(self.tid // Self.LPR, self.tid % Self.LPR)
        elif phase == EXPONENTIATE:
            self.softmax().exponentiate(self.tid // Self.LPR, self.tid % Self.LPR)
        elif phase == ACCUMULATE:
            self.accumulate()
        else:
            self.finish()

    @always_inline
    def load_queries(self):
        """Scaled queries into shared memory (zero rows past `rows()`), and
        every row's running max and sum reset."""
        stage_queries[Self.cache_t, Self.D, Self.BM](
            self.args, self.work, self.tid, self.smem.at(Self.Tiles.Q, 0), Self.Tiles.STRIDE
        )
        if self.tid < Self.BM:
            self.softmax().reset(self.tid)

    @always_inline
    def load_tile(self, kv_start: Int):
        """K and V of positions `kv_start ..< kv_start + BN` into shared
        memory as float32; positions outside the block's range (or the
        cache) as zeros. Every load is issued before the first store."""
        comptime per_row = Self.D // Self.VEC
        var keys = Array[SIMD[Self.dtype, Self.VEC], Self.UNITS](fill=0)
        var values = Array[SIMD[Self.dtype, Self.VEC], Self.UNITS](fill=0)
        var head_offset = self.work.kv_head * Self.D
        comptime for n in range(Self.UNITS):
            var unit = self.tid + n * BLOCK_THREADS
            var pos = kv_start + unit // per_row
            var d = (unit % per_row) * Self.VEC + head_offset
            if self.args.has_key(self.work, pos):
                keys[n] = self.args.k_cache.row_ptr(self.work.row, pos).unsafe_load[
                    width=Self.VEC, alignment=16
                ](d)
                values[n] = self.args.v_cache.row_ptr(self.work.row, pos).unsafe_load[
                    width=Self.VEC, alignment=16
                ](d)
        comptime for n in range(Self.UNITS):
            var unit = self.tid + n * BLOCK_THREADS
            var j = unit // per_row
            var d = (unit % per_row) * Self.VEC
            var k = keys[n].cast[DType.float32]()
            var v = values[n].cast[DType.float32]()
            comptime for e in range(Self.VEC):
                self.smem.at(Self.Tiles.K, j * Self.Tiles.STRIDE + d + e)[] = k[e]
                self.smem.at(Self.Tiles.V, j * Self.D + d + e)[] = v[e]

    @always_inline
    def score_tile(self, kv_start: Int):
        """Scores of the thread's rows and keys, -inf where masked. A thread
        whose rows are all past `rows()` skips the products."""
        var kg = self.tid % Self.KG
        var rg = self.tid // Self.KG
        var rows = self.rows()
        var scores = Array[Float32, Self.SR * Self.SK](fill=0)
        var q_base = self.smem.at(Self.Tiles.Q, rg * Self.Tiles.STRIDE)
        var k_base = self.smem.at(Self.Tiles.K, kg * Self.Tiles.STRIDE)
        if rg < rows:
            for d in range(Self.D):
                comptime for k in range(Self.SR):
                    var q = q_base[unsafe_offset=k * Self.RG * Self.Tiles.STRIDE + d]
                    comptime for i in range(Self.SK):
                        scores[k * Self.SK + i] += (
                            q * k_base[unsafe_offset=i * Self.KG * Self.Tiles.STRIDE + d]
                        )
        comptime for k in range(Self.SR):
            var r = rg + k * Self.RG
            var position = self.work.position(r, self.args.group)
            comptime for i in range(Self.SK):
                var j = kg + i * Self.KG
                var key = kv_start + j
                var visible = r < rows and key < self.work.kv_end and self.args.sees(position, key)
                self.softmax().score(r, j)[] = scores[k * Self.SK + i] if visible else NEG_INF

    @always_inline
    def accumulate(mut self):
        """Rescales the thread's outputs and adds this tile's weighted values
        (for the warp's rows that exist: the branch is the same in the whole
        warp); thread r < BM then folds the tile into row r's max and sum."""
        var warp = self.tid // WARP
        var lane = self.tid % WARP
        var rows = self.rows()
        comptime for k in range(Self.RPW):
            var alpha = self.softmax().alpha(warp + k * WARPS)
            comptime for i in range(Self.CPL):
                self.acc[k * Self.CPL + i] *= alpha
        var p_base = self.softmax().score(warp, 0)
        var v_base = self.smem.at(Self.Tiles.V, lane)
        for j in range(Self.BN):
            comptime for k in range(Self.RPW):
                if warp + k * WARPS < rows:
                    var p = p_base[unsafe_offset=k * WARPS * Self.BN + j]
                    comptime for i in range(Self.CPL):
                        self.acc[k * Self.CPL + i] += (
                            p * v_base[unsafe_offset=j * Self.D + i * WARP]
                        )
        if self.tid < Self.BM:
            self.softmax().update(self.tid)

    @always_inline
    def finish(self):
        """Normalised outputs, or this split's state for the merge."""
        var warp = self.tid // WARP
        var lane = self.tid % WARP
        var rows = self.rows()
        comptime for k in range(Self.RPW):
            var r = warp + k * WARPS
            if r < rows:
                comptime for i in range(Self.CPL):
                    write_row_part[Self.cache_t, Self.D, 1](
                        self.args,
                        self.work,
                        r,
                        lane + i * WARP,
                        self.acc[k * Self.CPL + i],
                        self.softmax().row_max(r),
                        self.softmax().row_sum(r),
                        lane == 0 and i == 0,
                    )


@fieldwise_init
struct AttentionKernel[cache_t: KVCacheT, D: Int, BM: Int, BN: Int, SK: Int](KernelT):
    """Grid (query tiles * splits, KV heads, batch rows) of prefill blocks."""

    comptime Program = AttentionThread[Self.cache_t, Self.D, Self.BM, Self.BN, Self.SK]
    comptime THREADS = BLOCK_THREADS
    comptime MIN_BLOCKS = 1

    var args: AttentionArgs[Self.cache_t]
    var query_tiles: Int

    def grid(self) -> BlockId:
        return BlockId(
            self.query_tiles * self.args.splits,
            self.args.k_cache.num_heads(),
            self.args.k_cache.batch_size(),
        )

    def shared_floats(self) -> Int:
        return Self.Program.Tiles.FLOATS

    @always_inline
    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return Self.Program(self.args, block_work(self.args, block, Self.BN), tid, shared)

    @always_inline
    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        var work = block_work(self.args, block, Self.BN)
        if work.empty():
            return
        threads.each(LOAD_Q, 0)
        threads.sync()
        var kv = work.kv_start
        while kv < work.kv_end:
            threads.each(LOAD_KV, kv)
            threads.sync()
            threads.each(SCORES, kv)
            threads.sync()
            threads.each(ROW_MAX, 0)
            threads.sync()
            threads.each(EXPONENTIATE, 0)
            threads.sync()
            threads.each(ACCUMULATE, 0)
            threads.sync()
            kv += Self.BN
        threads.each(FINISH, 0)


struct MergeThread[dtype: DType, D: Int](ThreadProgram):
    """Combines the split states of one (token, query head), each rescaled
    from its own max to the common one. Thread s first reads split s's max
    and sum and turns them into the split's weight, in shared memory
    (`[MAX_SPLITS]` maxima, sums, weights); then every thread sums its
    output dims over the splits with those weights, so each split's
    `exp2` is computed once, not once per dim, and no thread walks the
    splits' maxima through global memory."""

    comptime THREADS = 128
    comptime MAXIMA = 0
    comptime SUMS = MAX_SPLITS
    comptime WEIGHTS = 2 * MAX_SPLITS
    comptime FLOATS = 3 * MAX_SPLITS
    comptime UNROLL = 4
    """Splits whose values one thread loads before adding them: independent
    loads in flight instead of one at a time."""

    var args: MergeArgs[Self.dtype]
    var token: Int
    var head: Int
    var tid: Int
    var shared: F32Ptr

    def __init__(
        out self, args: MergeArgs[Self.dtype], token: Int, head: Int, tid: Int, shared: F32Ptr
    ):
        comptime assert MAX_SPLITS <= Self.THREADS, "one thread per split"
        self.args = args
        self.token = token
        self.head = head
        self.tid = tid
        self.shared = shared

    def state(self, split: Int) -> F32Ptr:
        return self.args.partials.unsafe_offset(
            split_state_offset(
                split, self.token, self.head, self.args.total_tokens, self.args.n_q_heads, Self.D
            )
        )

    @always_inline
    def step(mut self, phase: Int, arg: Int):
        if phase == MERGE_READ:
            self.read_split()
        elif phase == MERGE_WEIGH:
            self.weigh_split()
        else:
            self.combine()

    @always_inline
    def read_split(self):
        """Thread s < splits: split s's max and sum into shared memory."""
        if self.tid < self.args.splits:
            var state = self.state(self.tid)
            self.shared[unsafe_offset=Self.MAXIMA + self.tid] = state[unsafe_offset=Self.D]
            self.shared[unsafe_offset=Self.SUMS + self.tid] = state[unsafe_offset=Self.D + 1]

    @always_inline
    def weigh_split(self):
        """Thread s < splits: split s's weight `exp2(max_s - max)`, 0 for a
        split that saw no visible key."""
        if self.tid < self.args.splits:
            var best = NEG_INF
            for s in range(self.args.splits):
                best = max(best, self.shared[unsafe_offset=Self.MAXIMA + s])
            var own = self.shared[unsafe_offset=Self.MAXIMA + self.tid]
            var weight: Float32 = 0
            if own != NEG_INF:
                weight = exp2(own - best)
            self.shared[unsafe_offset=Self.WEIGHTS + self.tid] = weight

    @always_inline
    def combine(self):
        """Every thread: the weighted sum of its dims over the splits, over
        the weighted sum of the splits' sums. A split of weight 0 adds
        nothing, whatever its values hold (they may never have been
        written)."""
        var splits = self.args.splits
        var total: Float32 = 0
        for s in range(splits):
            var weight = self.shared[unsafe_offset=Self.WEIGHTS + s]
            if weight != 0:
                total += weight * self.shared[unsafe_offset=Self.SUMS + s]
        var inv: Float32 = 1 / total if total > 0 else 0
        var out = self.args.out.unsafe_offset(
            (self.token * self.args.n_q_heads + self.head) * Self.D
        )
        for d in range(self.tid, Self.D, Self.THREADS):
            var value: Float32 = 0
            var s = 0
            while s < splits:
                # Every load of the step first (index clamped, weight 0 past the end),
                # then the products: loads in flight together.
                var weights = SIMD[DType.float32, Self.UNROLL](0)
                var values = SIMD[DType.float32, Self.UNROLL](0)
                comptime for u in range(Self.UNROLL):
                    var split = min(s + u, splits - 1)
                    if s + u < splits:
                        weights[u] = self.shared[unsafe_offset=Self.WEIGHTS + split]
                    values[u] = self.state(split)[unsafe_offset=d]
                var used = weights.ne(SIMD[DType.float32, Self.UNROLL](0))
                value += used.select(
                    weights * values, SIMD[DType.float32, Self.UNROLL](0)
                ).reduce_add()
                s += Self.UNROLL
            out[unsafe_offset=d] = (value * inv).cast[Self.dtype]()


@fieldwise_init
struct MergeArgs[dtype: DType](TrivialRegisterPassable):
    var partials: F32Ptr
    var out: CachePtr[Self.dtype]
    var total_tokens: Int
    var n_q_heads: Int
    var splits: Int


@fieldwise_init
struct MergeKernel[dtype: DType, D: Int](KernelT):
    """Grid (tokens, query heads): one block per output row of a split batch."""

    comptime Program = MergeThread[Self.dtype, Self.D]
    comptime THREADS = MergeThread[Self.dtype, Self.D].THREADS
    comptime MIN_BLOCKS = 1

    var args: MergeArgs[Self.dtype]

    def grid(self) -> BlockId:
        return BlockId(self.args.total_tokens, self.args.n_q_heads, 1)

    def shared_floats(self) -> Int:
        return Self.Program.FLOATS

    @always_inline
    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return Self.Program(self.args, block.x, block.y, tid, shared)

    @always_inline
    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        threads.each(MERGE_READ, 0)
        threads.sync()
        threads.each(MERGE_WEIGH, 0)
        threads.sync()
        threads.each(MERGE_COMBINE, 0)


def _prefill_rows(head_dim: Int) -> Int:
    """Query rows of a prefill block: 64, or 32 for head_dim 256 (shared
    memory)."""
    return 32 if head_dim > 128 else 64


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
    else:
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

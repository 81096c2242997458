"""Flash decoding on a GPU: a few query rows (one token's GQA group, or up to
8 tokens when the group is smaller) against a long context, where the work is
reading K and V once, at memory speed.

One block of 128 threads per (query tile, KV head, batch row, split) walks its
context range in tiles of 128 keys, one key per thread:

- scores: thread j loads key j's row straight from the cache into registers
  (one page-table lookup) and dots it with every query row (the queries sit in
  shared memory as float32, each word read by all threads at once: a
  broadcast); it also copies value j's row, as stored, into shared memory
  (rows padded by 16 bytes, so the rows a warp writes at once start in
  different banks);
- the online softmax over the tile (`tile_softmax`);
- values: warp w owns query rows `RPW * w ..< RPW * (w + 1)`, lane c the `DPL`
  contiguous dims from `c * DPL`: per key, one vector read of the value row
  and one broadcast weight per row.

Four barriers per 128 keys, and no float32 copy of K or V. The split-K plan
and the merge of splits are `attention`'s; the prefill tile kernel there
serves larger query tiles."""

from std.math import ceildiv
from std.sys import size_of

from ..cache import CachePtr, KVCacheT
from .attention_work import (
    BLOCK_THREADS,
    DECODE_ROWS,
    NEG_INF,
    WARP,
    WARPS,
    AttentionArgs,
    BlockWork,
    block_work,
    stage_queries,
    write_row_part,
)
from .block import BlockExecutor, BlockId, F32Ptr, KernelT, ThreadProgram
from .rows import row_in_cache
from .tile_softmax import TileSoftmax

# Phases of a decode block (`DecodeThread.step`).
comptime LOAD_Q = 0
comptime SCORE = 1
comptime ROW_MAX = 2
comptime EXPONENTIATE = 3
comptime ACCUMULATE = 4
comptime FINISH = 5


struct DecodeThread[cache_t: KVCacheT, D: Int](ThreadProgram):
    """One thread of a decode block (layouts in the module docstring).
    Shared memory, in float32 words: queries `[BM, D]`, the softmax regions,
    then values `[BN, V_STRIDE]` in the cache's dtype."""

    comptime dtype = Self.cache_t.dtype
    comptime BM = DECODE_ROWS
    comptime BN = BLOCK_THREADS
    comptime ELEM = size_of[Scalar[Self.dtype]]()
    comptime VEC = 16 // Self.ELEM
    comptime CHUNKS = Self.D // Self.VEC
    comptime V_STRIDE = Self.D + Self.VEC
    comptime LPR = BLOCK_THREADS // Self.BM
    comptime RPW = Self.BM // WARPS
    comptime DPL = Self.D // WARP
    comptime V_ALIGN = min(Self.DPL * Self.ELEM, 16)
    comptime Softmax = TileSoftmax[Self.BM, Self.BN, Self.LPR]
    comptime SOFTMAX_AT = Self.BM * Self.D
    comptime V_AT = Self.SOFTMAX_AT + Self.Softmax.FLOATS
    comptime FLOATS = Self.V_AT + ceildiv(Self.BN * Self.V_STRIDE * Self.ELEM, 4)

    var args: AttentionArgs[Self.cache_t]
    var work: BlockWork
    var tid: Int
    var shared: F32Ptr
    var acc: Array[SIMD[DType.float32, Self.DPL], Self.RPW]

    def __init__(
        out self,
        args: AttentionArgs[Self.cache_t],
        work: BlockWork,
        tid: Int,
        shared: F32Ptr,
    ):
        comptime assert Self.D % WARP == 0 and Self.D % Self.VEC == 0, "head_dim layout"
        comptime assert Self.BM % WARPS == 0 and BLOCK_THREADS % Self.BM == 0, "row layout"
        comptime assert Self.V_AT % 4 == 0, "values must start 16-byte aligned"
        self.args = args
        self.work = work
        self.tid = tid
        self.shared = shared
        self.acc = Array[SIMD[DType.float32, Self.DPL], Self.RPW](fill=0)

    def rows(self) -> Int:
        return self.work.rows(self.args.group)

    def queries(self) -> F32Ptr:
        return self.shared

    def softmax(self) -> Self.Softmax:
        return Self.Softmax(self.shared.unsafe_offset(Self.SOFTMAX_AT))

    def values(self) -> CachePtr[Self.dtype]:
        return self.shared.unsafe_offset(Self.V_AT).unsafe_bitcast[Scalar[Self.dtype]]()

    def step(mut self, phase: Int, arg: Int):
        if phase == LOAD_Q:
            self.load_queries()
        elif phase == SCORE:
            self.score_key(arg)
        elif phase == ROW_MAX:
            self.softmax().partial_max(self.tid // Self.LPR, self.tid % Self.LPR)
        elif phase == EXPONENTIATE:
            self.softmax().exponentiate(self.tid // Self.LPR, self.tid % Self.LPR)
        elif phase == ACCUMULATE:
            self.accumulate()
        else:
            self.finish()

    def load_queries(self):
        """Scaled queries as float32 (zero rows past `rows()`); every row's
        running max and sum reset."""
        stage_queries[Self.cache_t, Self.D, Self.BM](
            self.args, self.work, self.tid, self.queries(), Self.D
        )
        if self.tid < Self.BM:
            self.softmax().reset(self.tid)

    def score_key(self, kv_start: Int):
        """Key `kv_start + tid`: its scores against every query row (-inf
        where masked or outside the block's range), and its value row into
        shared memory (zeros outside the range, so a zero weight stays 0)."""
        var j = self.tid
        var pos = kv_start + j
        var in_range = pos < self.work.kv_end and row_in_cache(
            self.args.k_cache, self.work.row, pos
        )
        var keys = Array[SIMD[Self.dtype, Self.VEC], Self.CHUNKS](fill=0)
        var values = Array[SIMD[Self.dtype, Self.VEC], Self.CHUNKS](fill=0)
        if in_range:
            var head_offset = self.work.kv_head * Self.D
            var k_row = self.args.k_cache.row_ptr(self.work.row, pos).unsafe_offset(head_offset)
            var v_row = self.args.v_cache.row_ptr(self.work.row, pos).unsafe_offset(head_offset)
            comptime for c in range(Self.CHUNKS):
                keys[c] = k_row.unsafe_load[width=Self.VEC, alignment=16](c * Self.VEC)
                values[c] = v_row.unsafe_load[width=Self.VEC, alignment=16](c * Self.VEC)
        var v_dst = self.values().unsafe_offset(j * Self.V_STRIDE)
        comptime for c in range(Self.CHUNKS):
            v_dst.unsafe_store[alignment=16](c * Self.VEC, values[c])
        var rows = self.rows()
        comptime for r in range(Self.BM):
            var score = NEG_INF
            var position = self.work.position(r, self.args.group)
            if (
                r < rows
                and in_range
                and pos <= position
                and pos >= self.args.visible_start(position)
            ):
                var dot = SIMD[DType.float32, Self.VEC](0)
                var q_row = self.queries().unsafe_offset(r * Self.D)
                comptime for c in range(Self.CHUNKS):
                    dot += (
                        q_row.unsafe_load[width=Self.VEC, alignment=16](c * Self.VEC)
                        * keys[c].cast[DType.float32]()
                    )
                score = dot.reduce_add()
            self.softmax().score(r, j)[] = score

    def accumulate(mut self):
        """Rescales the thread's outputs and adds the tile's weighted values
        (for the warp's rows that exist: the branch is the same in the whole
        warp); thread r < BM then folds the tile into row r's max and sum."""
        var warp = self.tid // WARP
        var lane = self.tid % WARP
        var first_row = warp * Self.RPW
        comptime for k in range(Self.RPW):
            self.acc[k] *= self.softmax().alpha(first_row + k)
        if first_row < self.rows():
            var column = self.values().unsafe_offset(lane * Self.DPL)
            for j in range(Self.BN):
                var v = column.unsafe_load[width=Self.DPL, alignment=Self.V_ALIGN](
                    j * Self.V_STRIDE
                ).cast[DType.float32]()
                comptime for k in range(Self.RPW):
                    self.acc[k] += self.softmax().score(first_row + k, j)[] * v
        if self.tid < Self.BM:
            self.softmax().update(self.tid)

    def finish(self):
        """Normalised outputs, or this split's state for the merge."""
        var warp = self.tid // WARP
        var lane = self.tid % WARP
        var rows = self.rows()
        comptime for k in range(Self.RPW):
            var r = warp * Self.RPW + k
            if r < rows:
                write_row_part[Self.cache_t, Self.D, Self.DPL](
                    self.args,
                    self.work,
                    r,
                    lane * Self.DPL,
                    self.acc[k],
                    self.softmax().row_max(r),
                    self.softmax().row_sum(r),
                    lane == 0,
                )


@fieldwise_init
struct DecodeKernel[cache_t: KVCacheT, D: Int](KernelT):
    """Grid (query tiles * splits, KV heads, batch rows) of decode blocks."""

    comptime Program = DecodeThread[Self.cache_t, Self.D]
    comptime THREADS = BLOCK_THREADS

    var args: AttentionArgs[Self.cache_t]
    var query_tiles: Int

    def grid(self) -> BlockId:
        return BlockId(
            self.query_tiles * self.args.splits,
            self.args.k_cache.num_heads(),
            self.args.k_cache.batch_size(),
        )

    def shared_floats(self) -> Int:
        return Self.Program.FLOATS

    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return Self.Program(
            self.args,
            block_work(self.args, block, Self.Program.BN),
            tid,
            shared,
        )

    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        var work = block_work(self.args, block, Self.Program.BN)
        if work.empty():
            return
        threads.each(LOAD_Q, 0)
        threads.sync()
        var kv = work.kv_start
        while kv < work.kv_end:
            threads.each(SCORE, kv)
            threads.sync()
            threads.each(ROW_MAX, 0)
            threads.sync()
            threads.each(EXPONENTIATE, 0)
            threads.sync()
            threads.each(ACCUMULATE, 0)
            threads.sync()
            kv += Self.Program.BN
        threads.each(FINISH, 0)

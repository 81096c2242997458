"""Flash decoding on a GPU: a few query rows (one token's GQA group, or up to
8 tokens when the group is smaller) against a long context, where the work is
reading K and V once, at memory speed.

One block of 128 threads per (query tile, KV head, batch row, split) walks its
context range in tiles of 128 keys, one key per thread:

- scores: thread j reads key j's row straight from the cache into registers
  (one page-table lookup), a quarter of the row at a time, and dots each
  quarter with every query row's matching dims (the queries sit in shared
  memory as float32, each word read by all threads at once: a broadcast); it
  also copies value j's row, as stored, into shared memory, quarter by
  quarter beside the key's (rows padded by 16 bytes, so the rows a warp
  writes at once start in different banks);
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
    comptime KEY_PARTS = 4
    """Parts a key and value row are read and used in (`score_key`)."""
    comptime PART_CHUNKS = Self.CHUNKS // Self.KEY_PARTS
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
        comptime assert Self.CHUNKS % Self.KEY_PARTS == 0, "key parts"
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

    @always_inline
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

    @always_inline
    def load_queries(self):
        """Scaled queries as float32 (zero rows past `rows()`); every row's
        running max and sum reset."""
        stage_queries[Self.cache_t, Self.D, Self.BM](
            self.args, self.work, self.tid, self.queries(), Self.D
        )
        if self.tid < Self.BM:
            self.softmax().reset(self.tid)

    @always_inline
    def score_key(self, kv_start: Int):
        """Key `kv_start + tid`: its scores against every query row (-inf
        where masked or outside the block's range), and its value row into
        shared memory (zeros outside the range, so a zero weight stays 0).

        Key and value rows are read in `KEY_PARTS` parts, each key part
        widened to float32 once and dotted with every query row's matching
        dims, each value part stored before the next is read. Whole rows
        (the compiler widens the key once for all query rows) held
        `head_dim` float32 registers plus the value row: 255 registers and
        spills for head_dim 128, two blocks per multiprocessor."""
        var j = self.tid
        var pos = kv_start + j
        var in_range = pos < self.work.kv_end and row_in_cache(
            self.args.k_cache, self.work.row, pos
        )
        var v_dst = self.values().unsafe_offset(j * Self.V_STRIDE)
        # The page table is read only for a key in range; otherwise the rows
        # stay pointed at `v_dst` and are never read.
        var k_row = v_dst
        var v_row = v_dst
        if in_range:
            var head_offset = self.work.kv_head * Self.D
            k_row = self.args.k_cache.row_ptr(self.work.row, pos).unsafe_offset(head_offset)
            v_row = self.args.v_cache.row_ptr(self.work.row, pos).unsafe_offset(head_offset)
        var rows = self.rows()
        var dots = SIMD[DType.float32, Self.BM](0)
        comptime for part in range(Self.KEY_PARTS):
            comptime first = part * Self.PART_CHUNKS
            var keys = Array[SIMD[DType.float32, Self.VEC], Self.PART_CHUNKS](fill=0)
            var values = Array[SIMD[Self.dtype, Self.VEC], Self.PART_CHUNKS](fill=0)
            if in_range:
                comptime for c in range(Self.PART_CHUNKS):
                    values[c] = v_row.unsafe_load[width=Self.VEC, alignment=16](
                        (first + c) * Self.VEC
                    )
                    keys[c] = k_row.unsafe_load[width=Self.VEC, alignment=16](
                        (first + c) * Self.VEC
                    ).cast[DType.float32]()
            comptime for c in range(Self.PART_CHUNKS):
                v_dst.unsafe_store[alignment=16]((first + c) * Self.VEC, values[c])
            comptime for r in range(Self.BM):
                if r < rows:
                    var dot = SIMD[DType.float32, Self.VEC](0)
                    var q_row = self.queries().unsafe_offset(r * Self.D)
                    comptime for c in range(Self.PART_CHUNKS):
                        dot += (
                            q_row.unsafe_load[width=Self.VEC, alignment=16]((first + c) * Self.VEC)
                            * keys[c]
                        )
                    dots[r] += dot.reduce_add()
        comptime for r in range(Self.BM):
            var visible = (
                r < rows
                and in_range
                and self.args.sees(self.work.position(r, self.args.group), pos)
            )
            self.softmax().score(r, j)[] = dots[r] if visible else NEG_INF

    @always_inline
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

    @always_inline
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
    comptime MIN_BLOCKS = 3 if Self.D <= 128 else 1
    """Three blocks per multiprocessor for head sizes to 128: ptxas then
    keeps the thread at 168 registers with at most a few bytes of spills
    (`tools/check_gpu_build.sh --registers`), where it would take ~200 and
    leave room for two (measured on the H200: 255 registers, 2 blocks,
    12% occupancy, the warps mostly waiting). Larger heads spill too
    much under that cap."""

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

    @always_inline
    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return Self.Program(
            self.args,
            block_work(self.args, block, Self.Program.BN),
            tid,
            shared,
        )

    @always_inline
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

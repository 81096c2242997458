"""The prefill tile kernel on CUDA cores: up to 64 query rows (32 for
head_dim 256) of one KV head's GQA group against the context in tiles of 32
keys, staged in shared memory as float32. Each thread scores a few rows
against a few keys, the block runs the online softmax (`softmax`), and each
thread keeps its share of the output rows in registers across tiles.

It serves float32 caches, and bfloat16 ones where the tensor-core kernel does
not run."""

from std.sys import size_of, bit_width_of

from ...pointers import CachePtr, F32Ptr
from ...cache.traits import KVCacheT
from ...kv_quantization import is_quantized
from ..codes import as_values, head_scales
from ..block import BlockExecutor, BlockId, KernelT, ThreadProgram
from ..warp import WARP
from .config import BLOCK_THREADS, NEG_INF, WARPS
from .plan import KernelFit
from .softmax import TileSoftmax
from .work import (
    AttentionArgs,
    BlockWork,
    attention_grid,
    block_work,
    stage_queries,
    write_row_part,
)

# Phases of a prefill block (`AttentionThread.step`).
comptime LOAD_Q = 0
comptime LOAD_KV = 1
comptime SCORES = 2
comptime ROW_MAX = 3
comptime EXPONENTIATE = 4
comptime ACCUMULATE = 5
comptime FINISH = 6


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


struct AttentionThread[cache_t: KVCacheT, q_dtype: DType, D: Int, BM: Int, BN: Int, SK: Int](
    ThreadProgram
):
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

    var args: AttentionArgs[Self.cache_t, Self.q_dtype]
    var work: BlockWork
    var tid: Int
    var smem: Self.Tiles
    var acc: Array[Float32, Self.RPW * Self.CPL]

    def __init__(
        out self,
        args: AttentionArgs[Self.cache_t, Self.q_dtype],
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
        stage_queries[Self.D, Self.BM](
            self.args, self.work, self.tid, self.smem.at(Self.Tiles.Q, 0), Self.Tiles.STRIDE
        )
        if self.tid < Self.BM:
            self.softmax().reset(self.tid)

    @always_inline
    def load_tile(self, kv_start: Int):
        """K and V of positions `kv_start ..< kv_start + BN` into shared
        memory as float32 (a quantized cache's codes times their scales);
        positions outside the block's range (or the cache) as zeros. Every
        load is issued before the first store."""
        comptime per_row = Self.D // Self.VEC
        var keys = Array[SIMD[Self.dtype, Self.VEC], Self.UNITS](fill=0)
        var values = Array[SIMD[Self.dtype, Self.VEC], Self.UNITS](fill=0)
        var scales = Array[SIMD[DType.float32, 2], Self.UNITS](fill=0)
        var head = self.work.kv_head
        comptime for n in range(Self.UNITS):
            var unit = self.tid + n * BLOCK_THREADS
            var pos = kv_start + unit // per_row
            var d = (unit % per_row) * Self.VEC
            var row = self.args.key_row(self.work, pos)
            if row != 0:
                keys[n] = CachePtr[Self.dtype](unsafe_from_address=row).unsafe_load[
                    width=Self.VEC, alignment=16
                ](head * Self.D + d)
                values[n] = self.args.v_cache.row_ptr(self.work.row, pos).unsafe_load[
                    width=Self.VEC, alignment=16
                ](head * Self.D + d)
                comptime if is_quantized[Self.dtype]():
                    var granule = d // self.args.granularity
                    scales[n] = SIMD[DType.float32, 2](
                        head_scales(self.args.k_cache, self.work.row, pos, head)[
                            unsafe_offset=granule
                        ],
                        head_scales(self.args.v_cache, self.work.row, pos, head)[
                            unsafe_offset=granule
                        ],
                    )
        comptime for n in range(Self.UNITS):
            var unit = self.tid + n * BLOCK_THREADS
            var j = unit // per_row
            var d = (unit % per_row) * Self.VEC
            var k = as_values(keys[n], scales[n][0])
            var v = as_values(values[n], scales[n][1])
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
                    write_row_part[Self.D, 1](
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
struct AttentionKernel[cache_t: KVCacheT, q_dtype: DType, D: Int, BM: Int, BN: Int, SK: Int](
    KernelT
):
    """Grid (query tiles * splits, KV heads, batch rows) of prefill blocks."""

    comptime Program = AttentionThread[
        Self.cache_t, Self.q_dtype, Self.D, Self.BM, Self.BN, Self.SK
    ]
    comptime THREADS = BLOCK_THREADS
    comptime MIN_BLOCKS = 1
    comptime NAME = "prefill"
    comptime HEAD_DIM = Self.D
    comptime ELEMENT_BITS = bit_width_of[Self.cache_t.dtype]()
    comptime SHARED_BYTES = Self.Program.Tiles.FLOATS * 4
    comptime FIT = KernelFit(Self.MIN_BLOCKS, Self.BN, query_rows=Self.BM)
    """What the planner cuts work for (`.plan.KernelFit`)."""

    var args: AttentionArgs[Self.cache_t, Self.q_dtype]

    def grid(self) -> BlockId:
        return attention_grid(self.args)

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

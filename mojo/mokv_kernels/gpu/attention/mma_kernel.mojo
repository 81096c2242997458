"""The grid and block schedule of the tensor-core attention kernels
(`MmaKernel`): which phases of `..mma.MmaThread` a block runs, in what
order, and where its threads meet. Three schedules:

- copies issued by the multiplying threads themselves: the first tiles'
  copies, then per tile a wait for its copies, a barrier (none in decode,
  whose warps wait only for their own keys) and its products; an 8-bit
  tile widened in shared memory takes one more phase and barrier;
- pipelined warpgroup products over a bfloat16 cache: each tile's keys
  land and are multiplied a tile early, so the next tile's wait and
  barrier come before this tile's softmax;
- a producer warpgroup (`producer`): it copies every tile while the two
  multiplying warpgroups consume them, the two sides handing stages over
  through shared-memory barriers, with no block barrier between tiles;
  on a GPU each side runs as far ahead as the barriers let it."""

from std.sys import bit_width_of

from ...cache.traits import KVCacheT
from ...pointers import F32Ptr
from ..block import BlockExecutor, BlockId, KernelT
from ..warpgroup import set_warpgroup_registers
from ..warp import WARP
from .config import DECODE_ROWS, WARPS
from .mma import (
    COMBINE,
    COMPUTE_TILE,
    CONVERT_TILE,
    FINISH,
    FIRST_SCORES,
    LOAD_Q,
    PRODUCE,
    START_FIRST,
    WAIT_TILE,
    MmaThread,
)
from .plan import KernelFit
from .producer import CONSUMER_REGISTERS, PRODUCER_REGISTERS
from .work import AttentionArgs, BlockWork, attention_grid, block_work


@fieldwise_init
struct MmaKernel[
    cache_t: KVCacheT,
    D: Int,
    lanes: Int,
    decode: Bool,
    warpgroup: Bool = False,
    scales_per_key: Bool = False,
    producer: Bool = False,
    boxes: Bool = False,
    warp_heads: Bool = False,
    block_heads: Int = WARPS,
](KernelT):
    """Grid (query tiles * splits, KV heads, batch rows) of tensor-core
    prefill or decode blocks (a prefill's products per warp, or per
    warpgroup where `warpgroup`; float16 products over an 8-bit cache with
    one scale per head row where `scales_per_key`, `MmaThread`). With
    `warp_heads` (decode), a block takes `block_heads` (four or eight)
    neighbouring KV heads, one a warp: a grid x of KV heads over
    `block_heads`."""

    comptime Program = MmaThread[
        Self.cache_t,
        Self.D,
        Self.lanes,
        Self.decode,
        Self.warpgroup,
        Self.scales_per_key,
        Self.producer,
        Self.boxes,
        Self.warp_heads,
        Self.block_heads,
    ]
    comptime THREADS = Self.Program.THREADS
    comptime DECODE_BLOCKS = 2 if Self.D >= 128 and (
        Self.Program.Tiles.WIDENED or Self.cache_t.dtype == DType.int8
    ) else (4 if Self.D < 128 and not Self.Program.Tiles.QUANTIZED else 3)
    comptime PREFILL_BLOCKS = 3 if Self.D < 128 and not Self.scales_per_key else 2
    comptime MIN_BLOCKS = 1 if Self.warpgroup or Self.block_heads > WARPS else (
        Self.DECODE_BLOCKS if Self.decode else Self.PREFILL_BLOCKS
    )
    """Blocks per multiprocessor the registers are sized for. A prefill at
    head_dim 64 fits three blocks' registers (168 each) and shared memory:
    twelve warps hide each other's latencies where eight did (the eighth
    run's profile found two warps per scheduler, mostly waiting); its
    float16 products of 8-bit codes spilled within three, and at head_dim
    128 three blocks' queries and stages outgrow the shared memory. A
    decode warp holds a quarter of a prefill warp's scores, and since its
    softmax runs on real rows only a bfloat16 decode at head_dim 64 fits
    four blocks' registers; an 8-bit decode that widens its tiles in shared
    memory at head_dim 128 spilled within three blocks', one that widens
    float8 codes in registers fits three (at head_dim 64 it spilled within
    four), int8 codes, whose widening takes a bias, a byte interleave and a
    subtraction, spilled within three at head_dim 128. A block of two
    warpgroups holds as many warps as two blocks of one, as does a decode
    block of eight KV heads, whose stages take most of a multiprocessor's
    shared memory (`MmaThread.STAGES`). Raise them only
    where `tools/check_gpu_build.sh --registers` shows no spills."""
    comptime FIT = KernelFit(
        Self.MIN_BLOCKS,
        Self.Program.STEP,
        Self.block_heads if Self.warp_heads else 1,
        DECODE_ROWS if Self.decode else Self.Program.ROWS,
    )
    """What the planner cuts work for (`..plan.KernelFit`)."""
    comptime LANES = Self.lanes
    comptime NAME = (
        (
            ("decode_mma_f16_heads8" if Self.scales_per_key else "decode_mma_heads8") if (
                Self.block_heads > WARPS
            ) else ("decode_mma_f16_heads" if Self.scales_per_key else "decode_mma_heads")
        ) if Self.warp_heads else ("decode_mma_f16" if Self.scales_per_key else "decode_mma")
    ) if Self.decode else (
        (
            "prefill_wgmma_tma" if Self.boxes else (
                "prefill_wgmma_producer" if Self.producer else "prefill_wgmma"
            )
        ) if Self.warpgroup else ("prefill_mma_f16" if Self.scales_per_key else "prefill_mma")
    )
    comptime HEAD_DIM = Self.D
    comptime ELEMENT_BITS = bit_width_of[Self.cache_t.dtype]()
    comptime SHARED_BYTES = Self.Program.SHARED_BYTES
    comptime TENSOR_CORES = True

    var args: AttentionArgs[Self.cache_t, DType.bfloat16]

    def grid(self) -> BlockId:
        var grid = attention_grid(self.args)
        comptime if Self.warp_heads:
            grid.x //= Self.block_heads
        return grid

    @always_inline
    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        """Thread `tid`'s program, its block's work (`warp_heads`: its
        warp's KV head's)."""
        var work = block_work(self.args, block, Self.Program.STEP)
        comptime if Self.warp_heads:
            work.kv_head = block.x * Self.block_heads + tid // WARP
        return Self.Program(self.args, work, tid, shared)

    @always_inline
    def between_tiles[E: BlockExecutor](self, mut threads: E):
        """The block's barrier between the phases of its tiles; none in
        decode, whose warps wait only for their own lanes (`per_warp`)."""
        comptime if not Self.decode:
            threads.sync()

    @always_inline
    def produced_schedule[E: BlockExecutor](self, mut threads: E, work: BlockWork):
        """`producer`: after the queries and the barriers, the producer
        warpgroup starts the first tiles, and from then on starts one tile
        while the consumers multiply another, the two handing stages over
        through their barriers, with no block barrier between tiles. On a
        GPU each warpgroup takes its own part of the sequence, in a branch
        of its own after `setmaxnreg`: ptxas sizes the registers of code
        after it to its count only where no path joins the other role's
        (with one loop of both roles' phases it kept the kernel's 168 and
        spilled); the emulator runs the whole sequence."""
        threads.each(LOAD_Q, work.kv_start)
        threads.sync()
        comptime if E.ONE_THREAD:
            if threads.thread() >= Self.Program.CONSUMER_THREADS:
                set_warpgroup_registers[PRODUCER_REGISTERS, increase=False]()
                comptime if Self.boxes:
                    # One warp starts the boxes; the others have no part.
                    if threads.thread() >= Self.Program.CONSUMER_THREADS + WARP:
                        return
                self.produced_tiles[produce=True, consume=False](threads, work)
            else:
                set_warpgroup_registers[CONSUMER_REGISTERS, increase=True]()
                self.produced_tiles[produce=False, consume=True](threads, work)
        else:
            self.produced_tiles[produce=True, consume=True](threads, work)

    @always_inline
    def produced_tiles[
        E: BlockExecutor, //, produce: Bool, consume: Bool
    ](self, mut threads: E, work: BlockWork):
        """The tiles' phases of `produced_schedule`, the producer's
        (`produce`), the consumers' (`consume`) or, interleaved, both's
        (the emulator's order): the producer starts tile t + `AHEAD` - 1
        before the consumers multiply tile t (its last tile's P V with it),
        into the stage of tile t - 2, released as tile t - 1 was multiplied.
        On a GPU each side runs as far ahead as the barriers let it."""
        comptime BN = Self.Program.BN
        comptime AHEAD = Self.Program.STAGES - 1
        comptime if produce:
            comptime for t in range(AHEAD):
                threads.each(PRODUCE, work.kv_start + t * BN)
        threads.handoff()
        comptime if consume:
            # A split may leave a block rows but no keys: then no tile comes.
            if work.kv_start < work.kv_end:
                threads.each(FIRST_SCORES, work.kv_start)
        # Each warpgroup takes its turn at every tile (`take_turn`).
        threads.handoff()
        var kv = work.kv_start + BN
        while kv < work.kv_end:
            comptime if produce:
                threads.each(PRODUCE, kv + (AHEAD - 1) * BN)
            comptime if consume:
                threads.each(COMPUTE_TILE, kv)
            threads.handoff()
            kv += BN
        comptime if consume:
            threads.each(FINISH, kv - BN)

    @always_inline
    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        var work = block_work(self.args, block, Self.Program.STEP)
        if work.empty():
            return
        comptime if Self.producer:
            self.produced_schedule(threads, work)
            return
        threads.each(LOAD_Q, work.kv_start)
        threads.sync()
        threads.each(START_FIRST, work.kv_start)
        self.between_tiles(threads)
        var kv = work.kv_start
        comptime if Self.Program.PIPELINED:
            # Each tile's keys land and are multiplied a tile early: the
            # next tile's wait and barrier come before this tile's softmax.
            threads.each(WAIT_TILE, kv)
            threads.sync()
            threads.each(FIRST_SCORES, kv)
            while kv < work.kv_end:
                if kv + Self.Program.BN < work.kv_end:
                    threads.each(WAIT_TILE, kv + Self.Program.BN)
                    threads.sync()
                threads.each(COMPUTE_TILE, kv)
                kv += Self.Program.BN
        else:
            while kv < work.kv_end:
                threads.each(WAIT_TILE, kv)
                self.between_tiles(threads)
                comptime if Self.Program.Tiles.WIDENED:
                    threads.each(CONVERT_TILE, kv)
                    self.between_tiles(threads)
                threads.each(COMPUTE_TILE, kv)
                kv += Self.Program.STEP
        comptime if Self.decode and not Self.warp_heads:
            threads.sync()
            threads.each(FINISH, 0)
            threads.sync()
            threads.each(COMBINE, 0)
        else:
            threads.each(FINISH, 0)

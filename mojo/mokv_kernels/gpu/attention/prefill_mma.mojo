"""The prefill tile kernel on tensor cores, for bfloat16 caches: Q Kᵀ and P V
as `mma.sync` m16n8k16 products with float32 accumulation (`..warp`).

A block of four warps holds `BM` = 64 query rows (tokens times the GQA
group of one KV head, `work`), sixteen per warp, so each K/V tile is read
once for the whole group. Its context is walked in tiles of `BN` = 64 keys:

- copies: K and V rows of a tile go through the page table row by row (one
  lookup per key, its address left in shared memory), in 16-byte
  `cp.async` chunks (`..copy`), into shared memory, XOR-swizzled
  (chunk c of row r at chunk `c ^ (r % 8)`), so the eight rows one
  `ldmatrix` reads sit in distinct banks; two stages, the next tile's copies
  in flight while this one computes;
- scores: a warp's queries stay in registers as A fragments for the whole
  context (loaded once, through the second stage's buffer); K fragments come
  from `ldmatrix`, four 8 x 8 matrices at a time; scores are scaled by
  `scale * log2(e)` in float32, after the product, so the queries stay exact;
- online softmax in registers: each lane holds two rows' scores (`warp`'s C
  layout), the quad of four lanes sharing a row combine maxima with two
  shuffles; sums stay per lane until the end;
- values: the probabilities are rounded to bfloat16 in registers and are
  the next product's A operand as they are (a C fragment pair is an A
  fragment), V fragments from the transposed `ldmatrix`.

One barrier per tile: after it, this tile's copies have landed in every
thread and every warp is done with the previous tile, whose stage the next
tile's copies then overwrite. Masking (causal, sliding window, the block's
context range, padding rows) happens only on tiles where some row does not
see every key. Under the emulator a program is a whole warp (`..warp`)."""

from std.math import exp2
from std.sys import size_of

from ...cache import CachePtr, KVCacheT
from ..block import BlockExecutor, BlockId, F32Ptr, KernelT, ThreadProgram
from ..copy import commit_copies, start_copy_16, wait_copies, zero_16
from ..warp import BF16Ptr, FragA, FragB, FragC, Frags, ld_matrix, mma, shuffle_xor
from .config import BLOCK_THREADS, NEG_INF, WARP, WARPS
from .work import AttentionArgs, BlockWork, block_work, row_offset, write_row_part

# Phases of a block (`MmaPrefillThread.step`).
comptime LOAD_Q = 0
comptime Q_FRAGMENTS = 1
comptime WAIT_TILE = 2
comptime COMPUTE_TILE = 3
comptime FINISH = 4

comptime MMA_ROWS = 16
"""Query rows of one warp: an m16n8k16 product's M."""
comptime BM = WARPS * MMA_ROWS
comptime BN = 64
"""Keys per tile."""
comptime STAGES = 2
comptime KEYS = 0
comptime VALUES = 1


struct MmaPrefillThread[cache_t: KVCacheT, D: Int, lanes: Int](ThreadProgram):
    """One thread of a block on a GPU (`lanes` 1), one warp under the
    emulator (`lanes` 32). Shared memory: `STAGES` pairs of K and V tiles
    `[BN, D]` of bfloat16, swizzled (the queries pass through stage 1's K
    tile), then per stage the `BN` key rows' addresses.
    Registers: the warp's query fragments, its output accumulators
    `[16, D]` (C fragments), and per row the running max and this lane's
    share of the running sum."""

    comptime KSTEPS = Self.D // 16
    """k-steps of a score product (16 dims each)."""
    comptime DTILES = Self.D // 8
    """Output n-tiles (8 dims each)."""
    comptime NTILES = BN // 8
    """Score n-tiles (8 keys each)."""
    comptime CHUNKS = Self.D // 8
    """16-byte chunks of a row."""
    comptime COPIES = BN * Self.CHUNKS // BLOCK_THREADS
    """Chunks of each of a tile's K and V that one thread copies."""
    comptime TILE = BN * Self.D
    comptime SHARED_BYTES = STAGES * 2 * Self.TILE * 2 + STAGES * BN * 8

    var args: AttentionArgs[Self.cache_t]
    var work: BlockWork
    var tid: Int
    """The program's first thread."""
    var smem: BF16Ptr
    var value_offset: Int
    """Elements from a token's key row to its value row: the cache's K and
    V of one layer are one block tensor's `kv_idx` 0 and 1, a fixed
    distance apart for every token (both layouts), so only keys are looked
    up in the page table and the value cache's state need not stay live."""
    var q: Frags[DType.bfloat16, 8, Self.KSTEPS, Self.lanes]
    var o: Frags[DType.float32, 4, Self.DTILES, Self.lanes]
    var row_max: Frags[DType.float32, 1, 2, Self.lanes]
    var row_sum: Frags[DType.float32, 1, 2, Self.lanes]

    def __init__(
        out self,
        args: AttentionArgs[Self.cache_t],
        work: BlockWork,
        tid: Int,
        shared: F32Ptr,
    ):
        comptime assert Self.cache_t.dtype == DType.bfloat16, "tensor-core tiles are bfloat16"
        comptime assert Self.D % 64 == 0, "the swizzle needs rows of 8 chunks or more"
        comptime assert Self.COPIES * BLOCK_THREADS == BN * Self.CHUNKS, "copy layout"
        comptime assert BM <= BN and STAGES >= 2, "the queries pass through stage 1's K tile"
        self.args = args
        self.work = work
        self.tid = tid
        self.smem = shared.unsafe_bitcast[BFloat16]()
        self.value_offset = 0
        if not work.empty():
            self.value_offset = (
                Int(args.v_cache.row_ptr(work.row, 0)) - Int(args.k_cache.row_ptr(work.row, 0))
            ) // size_of[BFloat16]()
        self.q = Frags[DType.bfloat16, 8, Self.KSTEPS, Self.lanes](0)
        self.o = Frags[DType.float32, 4, Self.DTILES, Self.lanes](0)
        self.row_max = Frags[DType.float32, 1, 2, Self.lanes](NEG_INF)
        self.row_sum = Frags[DType.float32, 1, 2, Self.lanes](0)

    @staticmethod
    def swizzled(row: Int, chunk: Int) -> Int:
        """Element offset of chunk `chunk` of row `row` in a `[*, D]` tile."""
        return row * Self.D + (chunk ^ (row % 8)) * 8

    def tile(self, stage: Int, kind: Int) -> BF16Ptr:
        return self.smem.unsafe_offset((stage * 2 + kind) * Self.TILE)

    def stage(self, kv_start: Int) -> Int:
        return (kv_start - self.work.kv_start) // BN % STAGES

    def lane(self, l: Int) -> Int:
        return self.tid % WARP + l

    def warp_row(self) -> Int:
        """The warp's first query row."""
        return self.tid // WARP * MMA_ROWS

    @always_inline
    def step(mut self, phase: Int, arg: Int):
        if phase == LOAD_Q:
            self.load_queries()
            self.locate_rows(arg)
        elif phase == Q_FRAGMENTS:
            self.query_fragments()
            self.start_tile(arg)
        elif phase == WAIT_TILE:
            if arg + BN < self.work.kv_end:
                self.locate_rows(arg + BN)
            wait_copies[0]()
        elif phase == COMPUTE_TILE:
            if arg + BN < self.work.kv_end:
                self.start_tile(arg + BN)
            self.compute_tile(arg)
        else:
            self.finish()

    @always_inline
    def load_queries(self):
        """The block's query rows into stage 1's K tile, swizzled (zero rows
        past the block's)."""
        var dest = self.tile(1, KEYS)
        var rows = self.work.rows(self.args.group)
        for l in range(Self.lanes):
            for u in range(self.tid + l, BM * Self.CHUNKS, BLOCK_THREADS):
                var r = u // Self.CHUNKS
                var c = u % Self.CHUNKS
                var to = dest.unsafe_offset(Self.swizzled(r, c))
                if r < rows:
                    var offset = row_offset[Self.cache_t, Self.D](self.args, self.work, r) + c * 8
                    to.unsafe_store[alignment=16](
                        0,
                        rebind[BF16Ptr](self.args.q).unsafe_load[width=8, alignment=16](offset),
                    )
                else:
                    zero_16(to)

    def addresses(self, kv_start: Int) -> Pointer[Int, MutUntrackedOrigin]:
        """The key row addresses of the tile at `kv_start` (its stage's slot)."""
        return (
            self.smem.unsafe_offset(STAGES * 2 * Self.TILE)
            .unsafe_bitcast[Int]()
            .unsafe_offset(self.stage(kv_start) * BN)
        )

    @always_inline
    def locate_rows(self, kv_start: Int):
        """Thread j < BN: the address of key `kv_start + j`'s row in the
        block's KV head (0 outside the block's range or the cache), one
        page-table lookup per key, where each chunk's copy would otherwise
        look its row up."""
        var head_offset = self.work.kv_head * Self.D
        for l in range(Self.lanes):
            var j = self.tid + l
            if j < BN:
                var pos = kv_start + j
                var address = 0
                if self.args.has_key(self.work, pos):
                    address = Int(
                        self.args.k_cache.row_ptr(self.work.row, pos).unsafe_offset(head_offset)
                    )
                self.addresses(kv_start)[unsafe_offset=j] = address

    @always_inline
    def start_tile(self, kv_start: Int):
        """Starts copying the K and V rows of the tile at `kv_start` into its
        stage (zeros for keys without an address), as one committed group.
        Thread t copies chunks t, t + 128, ...: a warp reads whole rows."""
        var stage = self.stage(kv_start)
        var keys = rebind[CachePtr[Self.cache_t.dtype]](self.tile(stage, KEYS))
        var values = rebind[CachePtr[Self.cache_t.dtype]](self.tile(stage, VALUES))
        var addresses = self.addresses(kv_start)
        for l in range(Self.lanes):
            for n in range(Self.COPIES):
                var unit = self.tid + l + n * BLOCK_THREADS
                var key = unit // Self.CHUNKS
                var c = unit % Self.CHUNKS
                var at = Self.swizzled(key, c)
                var address = addresses[unsafe_offset=key]
                if address != 0:
                    var source = CachePtr[Self.cache_t.dtype](unsafe_from_address=address)
                    start_copy_16(source.unsafe_offset(c * 8), keys.unsafe_offset(at))
                    start_copy_16(
                        source.unsafe_offset(self.value_offset + c * 8), values.unsafe_offset(at)
                    )
                else:
                    zero_16(keys.unsafe_offset(at))
                    zero_16(values.unsafe_offset(at))
        commit_copies()

    @always_inline
    def query_fragments(mut self):
        """The warp's query rows as A fragments, one per 16 dims."""
        var queries = self.tile(1, KEYS)
        comptime for k in range(Self.KSTEPS):
            var rows = Array[BF16Ptr, Self.lanes](fill=queries)
            for l in range(Self.lanes):
                var lane = self.lane(l)
                rows[l] = queries.unsafe_offset(
                    Self.swizzled(self.warp_row() + lane % 16, 2 * k + lane // 16)
                )
            self.q.set(k, ld_matrix[4, False, Self.lanes](rows))

    def tile_fully_visible(self, kv_start: Int) -> Bool:
        """Whether every query row of the block sees every key of the tile
        at `kv_start` (then nothing needs masking)."""
        var last_key = kv_start + BN - 1
        var rows = self.work.rows(self.args.group)
        var last_position = self.work.position(rows - 1, self.args.group)
        return (
            last_key < self.work.kv_end
            and last_key <= self.work.first_position
            and kv_start >= self.args.visible_start(last_position)
        )

    def visible_keys(self, kv_start: Int, l: Int, h: Int) -> SIMD[DType.int32, 2]:
        """The keys of the tile at `kv_start` that lane `l`'s row `h` sees,
        as offsets from the lane's first column (`8 n + e` is the lane's
        value e of score n-tile n): first and last, or an empty range for a
        padding row. Two 32-bit bounds per row, so masking a tile costs two
        comparisons per score."""
        var lane = self.lane(l)
        var r = self.warp_row() + lane // 4 + 8 * h
        if r >= self.work.rows(self.args.group):
            return SIMD[DType.int32, 2](1, 0)
        var position = self.work.position(r, self.args.group)
        var column = kv_start + 2 * (lane % 4)
        return SIMD[DType.int32, 2](
            Int32(max(self.args.visible_start(position) - column, -1)),
            Int32(min(position, self.work.kv_end - 1) - column),
        )

    @always_inline
    def scores(self, kv_start: Int) -> Frags[DType.float32, 4, Self.NTILES, Self.lanes]:
        """The warp's 16 rows' base-2 logits against the tile's keys, -inf
        where masked."""
        var keys = self.tile(self.stage(kv_start), KEYS)
        var s = Frags[DType.float32, 4, Self.NTILES, Self.lanes](0)
        comptime for k in range(Self.KSTEPS):
            var a = self.q.get(k)
            comptime for n2 in range(Self.NTILES // 2):
                var rows = Array[BF16Ptr, Self.lanes](fill=keys)
                for l in range(Self.lanes):
                    var lane = self.lane(l)
                    var key = n2 * 16 + lane // 16 * 8 + lane % 8
                    rows[l] = keys.unsafe_offset(Self.swizzled(key, 2 * k + lane // 8 % 2))
                var b = ld_matrix[4, False, Self.lanes](rows)
                var b0 = Array[FragB, Self.lanes](fill=0)
                var b1 = Array[FragB, Self.lanes](fill=0)
                for l in range(Self.lanes):
                    b0[l] = b[l].slice[4, offset=0]()
                    b1[l] = b[l].slice[4, offset=4]()
                s.set(2 * n2, mma[Self.lanes](a, b0, s.get(2 * n2)))
                s.set(2 * n2 + 1, mma[Self.lanes](a, b1, s.get(2 * n2 + 1)))
        var masked = not self.tile_fully_visible(kv_start)
        for l in range(Self.lanes):
            comptime for h in range(2):
                var visible = self.visible_keys(kv_start, l, h)
                comptime for n in range(Self.NTILES):
                    var c = s[n, l]
                    comptime for e in range(2):
                        var x = c[2 * h + e] * self.args.scale_log2
                        comptime local = Int32(n * 8 + e)
                        if masked and (local < visible[0] or local > visible[1]):
                            x = NEG_INF
                        c[2 * h + e] = x
                    s[n, l] = c
        return s^

    @always_inline
    def quad_max(
        self, s: Frags[DType.float32, 4, Self.NTILES, Self.lanes], h: Int
    ) -> Array[Float32, Self.lanes]:
        """Each lane's row `h` maximum over the tile, combined over the quad
        of lanes that share the row."""
        var best = Array[Float32, Self.lanes](fill=NEG_INF)
        for l in range(Self.lanes):
            comptime for n in range(Self.NTILES):
                best[l] = max(best[l], max(s[n, l][2 * h], s[n, l][2 * h + 1]))
        comptime for i in range(2):
            var other = shuffle_xor[Self.lanes](best, 1 << i)
            for l in range(Self.lanes):
                best[l] = max(best[l], other[l])
        return best^

    @always_inline
    def compute_tile(mut self, kv_start: Int):
        """Scores, the online softmax and the values of one tile."""
        var s = self.scores(kv_start)
        comptime for h in range(2):
            var best = self.quad_max(s, h)
            for l in range(Self.lanes):
                var new_max = max(self.row_max[h, l][0], best[l])
                var base = new_max if new_max != NEG_INF else 0
                var alpha = exp2(self.row_max[h, l][0] - base)
                var total: Float32 = 0
                comptime for n in range(Self.NTILES):
                    var c = s[n, l]
                    comptime for e in range(2):
                        var p = exp2(c[2 * h + e] - base)
                        c[2 * h + e] = p
                        total += p
                    s[n, l] = c
                self.row_max[h, l] = new_max
                self.row_sum[h, l] = self.row_sum[h, l] * alpha + total
                comptime for n in range(Self.DTILES):
                    var acc = self.o[n, l]
                    acc[2 * h] *= alpha
                    acc[2 * h + 1] *= alpha
                    self.o[n, l] = acc
        var values = self.tile(self.stage(kv_start), VALUES)
        comptime for j in range(BN // 16):
            var a = Array[FragA, Self.lanes](fill=0)
            for l in range(Self.lanes):
                a[l] = (
                    s[2 * j, l].cast[DType.bfloat16]().join(s[2 * j + 1, l].cast[DType.bfloat16]())
                )
            comptime for n2 in range(Self.DTILES // 2):
                var rows = Array[BF16Ptr, Self.lanes](fill=values)
                for l in range(Self.lanes):
                    var lane = self.lane(l)
                    var key = 16 * j + lane // 8 % 2 * 8 + lane % 8
                    rows[l] = values.unsafe_offset(Self.swizzled(key, 2 * n2 + lane // 16))
                var b = ld_matrix[4, True, Self.lanes](rows)
                var b0 = Array[FragB, Self.lanes](fill=0)
                var b1 = Array[FragB, Self.lanes](fill=0)
                for l in range(Self.lanes):
                    b0[l] = b[l].slice[4, offset=0]()
                    b1[l] = b[l].slice[4, offset=4]()
                self.o.set(2 * n2, mma[Self.lanes](a, b0, self.o.get(2 * n2)))
                self.o.set(2 * n2 + 1, mma[Self.lanes](a, b1, self.o.get(2 * n2 + 1)))

    @always_inline
    def finish(self):
        """Normalised outputs, or this split's state for the merge: each
        lane writes two dims of each of its two rows per output n-tile."""
        var rows = self.work.rows(self.args.group)
        comptime for h in range(2):
            var sums = Array[Float32, Self.lanes](fill=0)
            for l in range(Self.lanes):
                sums[l] = self.row_sum[h, l][0]
            comptime for i in range(2):
                var other = shuffle_xor[Self.lanes](sums, 1 << i)
                for l in range(Self.lanes):
                    sums[l] += other[l]
            for l in range(Self.lanes):
                var lane = self.lane(l)
                var r = self.warp_row() + lane // 4 + 8 * h
                if r < rows:
                    comptime for n in range(Self.DTILES):
                        var acc = self.o[n, l]
                        write_row_part[Self.cache_t, Self.D, 2](
                            self.args,
                            self.work,
                            r,
                            n * 8 + 2 * (lane % 4),
                            SIMD[DType.float32, 2](acc[2 * h], acc[2 * h + 1]),
                            self.row_max[h, l][0],
                            sums[l],
                            n == 0 and lane % 4 == 0,
                        )


@fieldwise_init
struct MmaPrefillKernel[cache_t: KVCacheT, D: Int, lanes: Int](KernelT):
    """Grid (query tiles * splits, KV heads, batch rows) of tensor-core
    prefill blocks."""

    comptime Program = MmaPrefillThread[Self.cache_t, Self.D, Self.lanes]
    comptime THREADS = BLOCK_THREADS
    comptime MIN_BLOCKS = 2
    """Two blocks per multiprocessor (eight warps): a thread's fragments
    take most of 255 registers; raise it only where `tools/
    check_gpu_build.sh --registers` shows no spills."""
    comptime LANES = Self.lanes

    var args: AttentionArgs[Self.cache_t]
    var query_tiles: Int

    def grid(self) -> BlockId:
        return BlockId(
            self.query_tiles * self.args.splits,
            self.args.k_cache.num_heads(),
            self.args.k_cache.batch_size(),
        )

    def shared_floats(self) -> Int:
        return Self.Program.SHARED_BYTES // 4

    @always_inline
    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return Self.Program(self.args, block_work(self.args, block, BN), tid, shared)

    @always_inline
    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        var work = block_work(self.args, block, BN)
        if work.empty():
            return
        threads.each(LOAD_Q, work.kv_start)
        threads.sync()
        threads.each(Q_FRAGMENTS, work.kv_start)
        var kv = work.kv_start
        while kv < work.kv_end:
            threads.each(WAIT_TILE, kv)
            threads.sync()
            threads.each(COMPUTE_TILE, kv)
            kv += BN
        threads.each(FINISH, 0)

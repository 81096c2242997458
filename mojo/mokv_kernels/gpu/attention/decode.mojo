"""Flash decoding on a GPU: a few query rows (one token's GQA group, or up to
8 tokens when the group is smaller) against a long context, where the work is
reading K and V once, at memory speed.

One block of 128 threads per (query tile, KV head, batch row, split) walks its
context range in tiles of up to 128 keys (as many as fit two tiles in
`TILE_PAIR_BYTES`), with the next tile's keys and this tile's values copied
into shared memory while it computes:

- thread j looks key j's rows up in the page table once, and leaves their
  addresses in shared memory (two slots: this tile's and the next's);
- copies are coalesced (consecutive threads copy consecutive 16-byte chunks
  of a row) and, on NVIDIA GPUs, asynchronous (`cp.async`: no registers
  held, the block computes while they land); rows are padded by 16 bytes,
  so the rows a warp later reads at once start in different banks (a thread
  reading a whole row of its own straight from the cache would touch 32
  cache lines per warp load, and copies only between phases would leave
  memory idle while the block computes);
- a quantized cache's scales: thread j copies key j's key scales, then
  its value scales, into shared memory with one wait each (read where they
  are used, every key's would be a global load all threads wait on);
- scores: thread j dots key j's row, a quarter at a time widened to
  float32, with every query row's matching dims (the queries sit in shared
  memory as float32, each word read by all threads at once: a broadcast);
- the online softmax over the tile (`softmax`);
- values: warp w owns query rows `RPW * w ..< RPW * (w + 1)`, lane c the `DPL`
  contiguous dims from `c * DPL`: per key, one vector read of the value row
  and one broadcast weight per row (four keys' weights per read).

Per tile, four phases and a barrier after each (`DecodeKernel.schedule`):
SCORE (which first starts copying this tile's values, and last locates the
next tile's rows), ROW_MAX (which first starts copying the next tile's keys),
EXPONENTIATE (then waits for the values), ACCUMULATE (then waits for the
keys). No float32 copy of K or V. The split-K plan and the merge of splits
are `plan`'s and `merge`'s; `prefill` serves larger query tiles."""

from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group
from std.math import ceildiv
from std.memory import AddressSpace
from std.sys import size_of, bit_width_of
from std.sys.info import is_nvidia_gpu

from ...cache.traits import KVCacheT
from ...pointers import CachePtr, F32Ptr, ScalePtr
from ...kv_quantization import is_quantized
from ..codes import as_values, head_scales
from ..block import BlockExecutor, BlockId, KernelT, ThreadProgram
from ..warp import WARP
from .config import BLOCK_THREADS, DECODE_ROWS, NEG_INF, QUANTIZED_CHUNK, WARPS
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

# Phases of a decode block (`DecodeThread.step`).
comptime LOAD_Q = 0
comptime LOAD_FIRST_KEYS = 1
comptime SCORE = 2
comptime ROW_MAX = 3
comptime EXPONENTIATE = 4
comptime ACCUMULATE = 5
comptime FINISH = 6

comptime KEYS = 0
comptime VALUES = 1
comptime KEY_SCALES = 2
comptime VALUE_SCALES = 3

comptime TILE_PAIR_BYTES = 48 * 1024
"""Shared memory a block's key and value tiles may take together: with the
queries and the softmax's regions, a block stays within the 64 KB of an AMD
workgroup, and four fit a Hopper multiprocessor's 228 KB."""


def _keys_per_tile(row_bytes: Int) -> Int:
    """The most keys, a power of two from 128 down to 16, whose key and value
    rows of `row_bytes` fit `TILE_PAIR_BYTES`."""
    var keys = BLOCK_THREADS
    while keys > 16 and 2 * keys * row_bytes > TILE_PAIR_BYTES:
        keys //= 2
    return keys


struct DecodeThread[cache_t: KVCacheT, q_dtype: DType, D: Int](ThreadProgram):
    """One thread of a decode block (layouts in the module docstring).
    Shared memory, in float32 words: queries `[BM, D]`, the softmax regions,
    row addresses `[2 slots, KINDS, BN]` (0 for a key outside the block's
    range or the cache), then the key tile and the value tile, each
    `[BN, ROW_STRIDE]` as stored (values, or a quantized cache's codes),
    then a quantized cache's scales of the tile's keys, `[2 (key, value),
    BN, CHUNKS]`: each 16-byte chunk's (its granule's), copied from where
    the addresses of the keys' scale rows say (0 for a key without a row),
    so a read needs no division by the granularity."""

    comptime dtype = Self.cache_t.dtype
    comptime BM = DECODE_ROWS
    comptime ELEM = size_of[Scalar[Self.dtype]]()
    comptime VEC = 16 // Self.ELEM
    comptime CHUNKS = Self.D // Self.VEC
    """16-byte chunks of a row."""
    comptime ROW_STRIDE = Self.D + Self.VEC
    comptime BN = _keys_per_tile(Self.ROW_STRIDE * Self.ELEM)
    """Keys per tile: one per thread of the first `BN`."""
    comptime COPIES = Self.BN * Self.CHUNKS // BLOCK_THREADS
    """Chunks of a tile each thread copies."""
    comptime KEY_PARTS = 4
    """Parts a key row is widened and dotted in (`score_key`)."""
    comptime KEY_PART_CHUNKS = Self.CHUNKS // Self.KEY_PARTS
    comptime LPR = BLOCK_THREADS // Self.BM
    comptime RPW = Self.BM // WARPS
    comptime DPL = Self.D // WARP
    comptime V_ALIGN = min(Self.DPL * Self.ELEM, 16)
    comptime KEYS_PER_READ = 4
    """Keys whose weights `accumulate` reads at once."""
    comptime Softmax = TileSoftmax[Self.BM, Self.BN, Self.LPR]
    comptime SOFTMAX_AT = Self.BM * Self.D
    comptime ADDRESSES_AT = Self.SOFTMAX_AT + Self.Softmax.FLOATS
    comptime KINDS = 4 if is_quantized[Self.dtype]() else 2
    """Addresses per key: its key and value rows, and their scale rows."""
    comptime TILES_AT = Self.ADDRESSES_AT + 2 * Self.KINDS * Self.BN * size_of[Int]() // 4
    comptime TILE_FLOATS = ceildiv(Self.BN * Self.ROW_STRIDE * Self.ELEM, 16) * 4
    comptime CHUNK_SCALES = Self.CHUNKS if is_quantized[Self.dtype]() else 0
    """Scales per key and kind in shared memory: one per chunk of codes
    (a granule is a multiple of `QUANTIZED_CHUNK`, a chunk's 16 codes);
    none for an unquantized cache."""
    comptime SCALES_AT = Self.TILES_AT + 2 * Self.TILE_FLOATS
    comptime FLOATS = Self.SCALES_AT + 2 * Self.BN * Self.CHUNK_SCALES

    var args: AttentionArgs[Self.cache_t, Self.q_dtype]
    var work: BlockWork
    var tid: Int
    var shared: F32Ptr
    var acc: Array[SIMD[DType.float32, Self.DPL], Self.RPW]

    def __init__(
        out self,
        args: AttentionArgs[Self.cache_t, Self.q_dtype],
        work: BlockWork,
        tid: Int,
        shared: F32Ptr,
    ):
        comptime assert Self.D % WARP == 0 and Self.D % Self.VEC == 0, "head_dim layout"
        comptime assert Self.BM % WARPS == 0 and BLOCK_THREADS % Self.BM == 0, "row layout"
        comptime assert Self.CHUNKS % Self.KEY_PARTS == 0, "key parts"
        comptime assert (
            not is_quantized[Self.dtype]() or Self.VEC == QUANTIZED_CHUNK
        ), "a chunk of codes must lie in one granule"
        comptime assert Self.COPIES * BLOCK_THREADS == Self.BN * Self.CHUNKS, "copies"
        comptime assert Self.BN % Self.KEYS_PER_READ == 0, "weight reads"
        comptime assert Self.ADDRESSES_AT % 2 == 0, "addresses must be 8-byte aligned"
        comptime assert Self.TILES_AT % 4 == 0, "tiles must start 16-byte aligned"
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

    def addresses(self, kv_start: Int, kind: Int) -> Pointer[Int, MutUntrackedOrigin]:
        """Where the key (`kind` KEYS) or value (VALUES) row addresses, or
        their scale rows' (KEY_SCALES, VALUE_SCALES), of the tile at
        `kv_start` live: tiles alternate between two slots."""
        var slot = (kv_start - self.work.kv_start) // Self.BN % 2
        return (
            self.shared.unsafe_offset(Self.ADDRESSES_AT)
            .unsafe_bitcast[Int]()
            .unsafe_offset((slot * Self.KINDS + kind) * Self.BN)
        )

    def scales(self, kind: Int, j: Int) -> F32Ptr:
        """Where the tile's key `j`'s key (`kind` KEY_SCALES) or value
        (VALUE_SCALES) scales are copied to (`copy_scales`)."""
        return self.shared.unsafe_offset(
            Self.SCALES_AT + ((kind - KEY_SCALES) * Self.BN + j) * Self.CHUNK_SCALES
        )

    def scale(self, kind: Int, j: Int, d: Int) -> Float32:
        """The scale of element `d` of the block's head of the tile's key `j`
        (`kind` KEY_SCALES or VALUE_SCALES): 0 for a key without a row, 1
        for an unquantized cache."""
        comptime if is_quantized[Self.dtype]():
            return self.scales(kind, j)[unsafe_offset=d // Self.VEC]
        else:
            return 1

    def tile(self, kind: Int) -> CachePtr[Self.dtype]:
        """The key (`kind` KEYS) or value (VALUES) tile."""
        return self.shared.unsafe_offset(Self.TILES_AT + kind * Self.TILE_FLOATS).unsafe_bitcast[
            Scalar[Self.dtype]
        ]()

    @always_inline
    def step(mut self, phase: Int, arg: Int):
        var next = arg + Self.BN
        if phase == LOAD_Q:
            self.load_queries()
            self.locate_rows(arg)
        elif phase == LOAD_FIRST_KEYS:
            self.start_copy(arg, KEYS)
            async_copy_commit_group()
            async_copy_wait_group(0)
        elif phase == SCORE:
            self.start_copy(arg, VALUES)
            async_copy_commit_group()
            self.score_key(arg)
            if next < self.work.kv_end:
                self.locate_rows(next)
        elif phase == ROW_MAX:
            if next < self.work.kv_end:
                self.start_copy(next, KEYS)
            # A group even when empty, so that EXPONENTIATE's wait for all
            # but the newest group always waits for this tile's values.
            async_copy_commit_group()
            comptime if is_quantized[Self.dtype]():
                self.copy_scales(arg, VALUE_SCALES)
            self.softmax().partial_max(self.tid // Self.LPR, self.tid % Self.LPR)
        elif phase == EXPONENTIATE:
            self.softmax().exponentiate(self.tid // Self.LPR, self.tid % Self.LPR)
            async_copy_wait_group(1)
        elif phase == ACCUMULATE:
            self.accumulate(arg)
            async_copy_wait_group(0)
        else:
            self.finish()

    @always_inline
    def load_queries(self):
        """Scaled queries as float32 (zero rows past `rows()`); every row's
        running max and sum reset."""
        stage_queries[Self.D, Self.BM](self.args, self.work, self.tid, self.queries(), Self.D)
        if self.tid < Self.BM:
            self.softmax().reset(self.tid)

    @always_inline
    def locate_rows(self, kv_start: Int):
        """The addresses of key `kv_start + tid`'s rows in this block's KV
        head, for the tile that starts there (0 outside the block's range or
        the cache): one page-table lookup per key, where each copy would
        otherwise look up every row it reads."""
        if self.tid >= Self.BN:
            return
        var pos = kv_start + self.tid
        var row = self.args.key_row(self.work, pos)
        var found = row != 0
        var head = self.work.kv_head
        var k_address = 0
        var v_address = 0
        if found:
            k_address = Int(
                CachePtr[Self.dtype](unsafe_from_address=row).unsafe_offset(head * Self.D)
            )
            v_address = Int(
                self.args.v_cache.row_ptr(self.work.row, pos).unsafe_offset(head * Self.D)
            )
        self.addresses(kv_start, KEYS)[unsafe_offset=self.tid] = k_address
        self.addresses(kv_start, VALUES)[unsafe_offset=self.tid] = v_address
        comptime if is_quantized[Self.dtype]():
            var k_scales = 0
            var v_scales = 0
            if found:
                k_scales = Int(head_scales(self.args.k_cache, self.work.row, pos, head))
                v_scales = Int(head_scales(self.args.v_cache, self.work.row, pos, head))
            self.addresses(kv_start, KEY_SCALES)[unsafe_offset=self.tid] = k_scales
            self.addresses(kv_start, VALUE_SCALES)[unsafe_offset=self.tid] = v_scales

    @always_inline
    def start_copy(self, kv_start: Int, kind: Int):
        """Starts copying the key or value rows of the tile at `kv_start`
        into their tile, as stored (zeros for a key without an address),
        as asynchronous copies that the caller commits as one group
        (`async_copy_wait_group` then says when they have landed). Thread t
        copies chunks t, t + BLOCK_THREADS, ... of the tile, so a warp reads
        whole rows. Where `cp.async` does not exist (other GPUs, the CPU
        emulator) the copies complete here. A loop, not unrolled: unrolled,
        ptxas held every copy's address at once and spilled."""
        var sources = self.addresses(kv_start, kind)
        var dest = self.tile(kind)
        for n in range(Self.COPIES):
            var unit = self.tid + n * BLOCK_THREADS
            var address = sources[unsafe_offset=unit // Self.CHUNKS]
            var offset = (unit % Self.CHUNKS) * Self.VEC
            var to = dest.unsafe_offset((unit // Self.CHUNKS) * Self.ROW_STRIDE + offset)
            if address == 0:
                to.unsafe_store[alignment=16](0, SIMD[Self.dtype, Self.VEC](0))
                continue
            var source = CachePtr[Self.dtype](unsafe_from_address=address).unsafe_offset(offset)
            comptime if is_nvidia_gpu():
                async_copy[16](
                    source.unsafe_address_space_cast[AddressSpace.GLOBAL](),
                    to.unsafe_address_space_cast[AddressSpace.SHARED](),
                )
            else:
                to.unsafe_store[alignment=16](
                    0, source.unsafe_load[width=Self.VEC, alignment=16](0)
                )

    @always_inline
    def copy_scales(self, kv_start: Int, kind: Int):
        """Thread j < BN copies key j's key (`kind` KEY_SCALES) or value
        (VALUE_SCALES) scales of the tile at `kv_start` into shared memory,
        each chunk's (its granule's: chunk c of `CHUNKS` is in granule
        `c * granules // CHUNKS`),
        every load issued before the first store: one wait per tile, where
        reading each scale as it is used waited on a global load key after
        key. The keys' are copied as SCORE starts, the values' in ROW_MAX
        (not beside the keys': the registers of both spilled), and read in
        this tile's ACCUMULATE, so the next tile's may overwrite them."""
        var j = self.tid
        if j >= Self.BN:
            return
        var address = self.addresses(kv_start, kind)[unsafe_offset=j]
        var source = ScalePtr(unsafe_from_address=address)
        var scales = SIMD[DType.float32, Self.CHUNKS](0)
        if address != 0:
            var granules = Self.D // self.args.granularity
            comptime for c in range(Self.CHUNKS):
                scales[c] = source[unsafe_offset=c * granules // Self.CHUNKS]
        comptime for c in range(Self.CHUNKS):
            self.scales(kind, j)[unsafe_offset=c] = scales[c]

    @always_inline
    def score_key(self, kv_start: Int):
        """Key `kv_start + tid`'s scores against every query row (-inf where
        masked or outside the block's range; threads past `BN` have none),
        from its row in the tile, read and widened to float32 in
        `KEY_PARTS` parts: a whole row widened at once held `head_dim`
        float32 registers."""
        var j = self.tid
        if j >= Self.BN:
            return
        comptime if is_quantized[Self.dtype]():
            self.copy_scales(kv_start, KEY_SCALES)
        var pos = kv_start + j
        var in_range = self.addresses(kv_start, KEYS)[unsafe_offset=j] != 0
        var key = self.tile(KEYS).unsafe_offset(j * Self.ROW_STRIDE)
        var rows = self.rows()
        var dots = SIMD[DType.float32, Self.BM](0)
        comptime for part in range(Self.KEY_PARTS):
            comptime first = part * Self.KEY_PART_CHUNKS
            var keys = Array[SIMD[DType.float32, Self.VEC], Self.KEY_PART_CHUNKS](fill=0)
            if in_range:
                comptime for c in range(Self.KEY_PART_CHUNKS):
                    comptime d = (first + c) * Self.VEC
                    keys[c] = as_values(
                        key.unsafe_load[width=Self.VEC, alignment=16](d),
                        self.scale(KEY_SCALES, j, d),
                    )
            comptime for r in range(Self.BM):
                if r < rows:
                    var dot = SIMD[DType.float32, Self.VEC](0)
                    var q_row = self.queries().unsafe_offset(r * Self.D)
                    comptime for c in range(Self.KEY_PART_CHUNKS):
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
    def accumulate(mut self, kv_start: Int):
        """Rescales the thread's outputs and adds the tile's weighted values
        (for the warp's rows that exist: the branch is the same in the whole
        warp); thread r < BM then folds the tile into row r's max and sum."""
        var warp = self.tid // WARP
        var lane = self.tid % WARP
        var first_row = warp * Self.RPW
        comptime for k in range(Self.RPW):
            self.acc[k] *= self.softmax().alpha(first_row + k)
        if first_row < self.rows():
            var column = self.tile(VALUES).unsafe_offset(lane * Self.DPL)
            for j0 in range(0, Self.BN, Self.KEYS_PER_READ):
                var weights = Array[SIMD[DType.float32, Self.KEYS_PER_READ], Self.RPW](fill=0)
                comptime for k in range(Self.RPW):
                    weights[k] = (
                        self.softmax()
                        .score(first_row + k, j0)
                        .unsafe_load[width=Self.KEYS_PER_READ, alignment=16]()
                    )
                comptime for i in range(Self.KEYS_PER_READ):
                    var v = as_values(
                        column.unsafe_load[width=Self.DPL, alignment=Self.V_ALIGN](
                            (j0 + i) * Self.ROW_STRIDE
                        ),
                        self.scale(VALUE_SCALES, j0 + i, lane * Self.DPL),
                    )
                    comptime for k in range(Self.RPW):
                        self.acc[k] += weights[k][i] * v
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
                write_row_part[Self.D, Self.DPL](
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
struct DecodeKernel[cache_t: KVCacheT, q_dtype: DType, D: Int](KernelT):
    """Grid (query tiles * splits, KV heads, batch rows) of decode blocks."""

    comptime Program = DecodeThread[Self.cache_t, Self.q_dtype, Self.D]
    comptime THREADS = BLOCK_THREADS
    comptime NAME = "decode"
    comptime HEAD_DIM = Self.D
    comptime ELEMENT_BITS = bit_width_of[Self.cache_t.dtype]()
    comptime SHARED_BYTES = Self.Program.FLOATS * 4
    comptime MIN_BLOCKS = 3 if Self.D < 128 or (
        Self.D == 128 and not is_quantized[Self.cache_t.dtype]()
    ) else 2
    """Blocks per multiprocessor the registers are sized for (their shared
    memory lets more run); `tools/check_gpu_build.sh --registers` shows
    what ptxas gives, and that it does not spill. An 8-bit cache at head_dim
    128 spilled within three blocks' registers once its scales were staged
    in shared memory."""
    comptime FIT = KernelFit(Self.MIN_BLOCKS, Self.Program.BN)
    """What the planner cuts work for (`.plan.KernelFit`)."""

    var args: AttentionArgs[Self.cache_t, Self.q_dtype]

    def grid(self) -> BlockId:
        return attention_grid(self.args)

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
        threads.each(LOAD_Q, work.kv_start)
        threads.sync()
        threads.each(LOAD_FIRST_KEYS, work.kv_start)
        threads.sync()
        var kv = work.kv_start
        while kv < work.kv_end:
            threads.each(SCORE, kv)
            threads.sync()
            threads.each(ROW_MAX, kv)
            threads.sync()
            threads.each(EXPONENTIATE, kv)
            threads.sync()
            threads.each(ACCUMULATE, kv)
            threads.sync()
            kv += Self.Program.BN
        threads.each(FINISH, 0)

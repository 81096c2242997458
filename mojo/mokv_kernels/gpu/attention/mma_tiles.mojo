"""A tensor-core attention block's shared memory (`mma`), and how the
queries and the K/V tiles get there.

Layout: the block's queries `[ROWS, D]`, then `stage_count` pairs of K and V
tiles `[BN, D]` (one pair for an 8-bit cache, below), each a swizzled
tile (`..swizzle`: D / 64 column blocks of 128-byte rows, chunk c of row r
at chunk `c ^ (r % 8)`: the eight rows one `ldmatrix` reads sit in
distinct banks, and a `wgmma` reads the tile through a descriptor), then an 8-bit cache's code stages, then per stage the `BN` key
rows' addresses.

K and V rows of a tile go through the page table row by row: one thread per
key looks its row up once (`locate_rows`) and leaves the address in shared
memory, then every thread copies 16-byte chunks with `cp.async` (`..copy`),
committed as one group per tile: a few neighbouring lanes share a key
(`LANES_PER_KEY`: eight take a whole 128-byte line of a row per copy
instruction), so a thread reads the addresses of a few keys a tile
(`copy_key`), not one per copy.
With `per_warp` (decode, whose warps each read only their own `BN / WARPS`
keys of a tile) each warp locates and copies its own keys' rows, so a warp
needs only its own copies and a warp barrier, never the block's, between
tiles. With `warp_heads` too (a decode block of one KV head a warp), warp w's
keys are the tile's `WARP_KEYS` positions in its own head, and its query rows
that head's: the four warps read neighbouring rows of the same tokens. The
query tile then holds each head's `DECODE_ROWS` rows, not the 16 of its
products (rows 8 to 15 are padding, whose weights the softmax zeroes): three
blocks' shared memory still fit a multiprocessor.

An 8-bit cache (`float8_e4m3fn` or `int8` codes with float32 scales) takes
the same path to tensor cores: each tile's codes `[BN, D]` and its keys'
scales are copied as they are (`cp.async`, the scales 4 bytes at a time)
into one of `stage_count` code stages, then every thread widens its chunks
times their scales to bfloat16 into the one bfloat16 stage
(`convert_tile`), or with one scale per head row (`scales_per_key`) the
codes' own values as float16, the keys' scales apart for the products. A
code stage is free again once converted, so all
`stage_count` of them hold tiles in flight while one is multiplied: a tile
of codes is half a bfloat16 tile's bytes, and the stages keep as many bytes
in flight. A decode with one scale per head row (`IN_REGISTERS`) has no
bfloat16 stage: its warps read their codes from the code stage into
registers (`code_tile`), so that stage is busy while its tile is multiplied.
Code rows are XOR-swizzled in 16-byte chunks (`code_chunk`). No thread
loads a scale from global memory while the block waits on it. Each key's
key scales are looked up beside its row; its value scales lie a fixed
distance from them, as its value row does from its key row."""

from std.math import log2
from std.memory import bitcast
from std.sys import size_of

from ...cache.traits import KVCacheT
from ...kv_quantization import is_quantized
from ...pointers import BF16Ptr, BytePtr, CachePtr, F32Ptr, ScalePtr

from ..codes import as_values, codes_as_float16, head_scales_in_page
from ..copy import commit_copies, start_copy, start_copy_or_zeros, zero_16
from ..rows import row_in_table_page, table_page

from ..shared_memory import SharedMemory
from ..swizzle import SWIZZLE_ALIGNMENT, SWIZZLE_COLUMNS, swizzled
from ..warp import WARP

from .config import DECODE_ROWS, QUANTIZED_CHUNK
from .work import AttentionArgs, BlockWork, row_offset

comptime TILE_KEYS = 64
"""Keys per tile (`BN`) of every tensor-core kernel (`..mma.MmaThread.BN`)."""
comptime KEYS = 0
comptime VALUES = 1
comptime KEY_SCALES = 1
"""The address kind of a key's key scales beside its row (`addresses`, an
8-bit cache only; its value scales are `scale_value_offset` further)."""
comptime SMALLEST_VALUE_SCALE = Float32(2.0**-100)
"""Value scales below it (a row of zeros has scale 0) count as it in their
keys' log-weights (`value_log_scales`): their values are that small."""


@always_inline
def value_log_scales[width: Int](scales: SIMD[DType.float32, width]) -> SIMD[DType.float32, width]:
    """What a key's log-weight adds for its value scale (`scales_per_key`,
    `..mma.MmaThread`): its base-2 log, `SMALLEST_VALUE_SCALE`'s at least."""
    return log2(max(scales, SMALLEST_VALUE_SCALE))


def code_chunk[D: Int](key: Int, chunk: Int) -> Int:
    """Bytes from a code tile's start to 16-byte chunk `chunk` of row
    `key`: rows of `D` codes back to back (`128 // D` to a 128-byte line),
    the eight chunks of each line XOR-swizzled by the line's first row
    modulo 8, so that the chunks the lanes of a quarter warp read
    (`..mma_products.WarpProducts.code_scores`: two neighbouring rows;
    `code_values`: every other row) lie in distinct banks."""
    var unit = key * (D // 16) + chunk
    return 16 * (unit ^ (unit // 8 * (128 // D) % 8))


def head_first_row[warp_heads: Bool](thread: Int) -> Int:
    """The query tile's row of `thread`'s KV head's first query row: with
    `warp_heads` (each warp its own head's `DECODE_ROWS`) its warp's, else
    0."""
    return thread // WARP * DECODE_ROWS if warp_heads else 0


@always_inline
def ring_stage[BN: Int, stages: Int](first_key: Int, kv_start: Int) -> Int:
    """The stage of the tile at `kv_start` when tiles of `BN` keys from
    `first_key` take `stages` stages in turn (32-bit: a block's keys are far
    fewer than 2^32, and 64-bit division costs a dozen instructions more on
    every tile)."""
    return Int(UInt32(kv_start - first_key) // UInt32(BN) % UInt32(stages))


@fieldwise_init
struct MmaTiles[
    cache_t: KVCacheT,
    D: Int,
    ROWS: Int,
    THREADS: Int,
    stage_count: Int,
    per_warp: Bool,
    scales_per_key: Bool,
    BN: Int,
    located: Bool = True,
    warp_heads: Bool = False,
](TrivialRegisterPassable):
    """The shared memory of a block of `THREADS` threads, from `smem`; tiles
    of `BN` keys take the `stage_count` stages (an 8-bit cache: code stages)
    in turn from the block's first key `first_key`; each warp copies its own keys when
    `per_warp` (see the module docstring). `located`: the threads locate
    each key's row into shared memory for their `cp.async` copies
    (`addresses`); tensor-map boxes look their pages up themselves.
    `warp_heads` (with `per_warp`): each warp's keys and query rows are its
    own KV head's (`work.kv_head` of the `work` it passes), its keys the
    tile's first `WARP_KEYS` positions (`key_position`), its query rows
    `HEAD_ROWS` from `HEAD_ROWS` times the warp.

    `scales_per_key`: an 8-bit cache with one scale per head row, whose
    tiles hold float16 (its codes' own values: `convert_tile`) and its
    queries float16 scaled by a power of two per row (`load_queries`), for
    float16 products; otherwise every tile and the queries are bfloat16."""

    comptime QUANTIZED = is_quantized[Self.cache_t.dtype]()
    comptime IN_REGISTERS = Self.scales_per_key and Self.per_warp
    """A decode over an 8-bit cache with one scale per head row: each warp
    widens its own keys' codes in registers as its products take them
    (`code_tile`, `..mma_products`), so there is no bfloat16
    stage, no widening pass through shared memory and no second barrier
    per tile."""
    comptime WIDENED = Self.QUANTIZED and not Self.IN_REGISTERS
    """An 8-bit cache whose codes `convert_tile` widens into a stage."""
    comptime TILES_AHEAD = Self.stage_count if Self.WIDENED else Self.stage_count - 1
    """Tiles whose copies are in flight while one is multiplied: every stage
    but the one being read, or every code stage (read before the products,
    by `convert_tile`)."""
    comptime VALUE_STAGES = 0 if Self.IN_REGISTERS else (1 if Self.QUANTIZED else Self.stage_count)
    """Stages of bfloat16 K and V tiles."""
    comptime MAX_GRANULES = Self.D // QUANTIZED_CHUNK
    """Most scales per head row of an 8-bit cache (a granule is whole
    16-code chunks)."""
    comptime STAGED_SCALES = 1 if Self.scales_per_key else Self.MAX_GRANULES
    """Scales a key takes in a code stage, for each of K and V (not the
    address kind `KEY_SCALES`)."""
    comptime CHUNKS = Self.D // 8
    """16-byte chunks of a bfloat16 row."""
    comptime WARP_KEYS = Self.BN // (Self.THREADS // WARP)
    """Keys of a tile that each warp copies when `per_warp`."""
    comptime STEP = Self.WARP_KEYS if Self.warp_heads else Self.BN
    """Context positions a tile spans: with `warp_heads` each warp's rows of
    a stage are its head's keys at the same positions."""
    comptime HEAD_ROWS = DECODE_ROWS if Self.warp_heads else Self.ROWS
    """Query rows of one KV head: a warp's with `warp_heads`, else the
    block's."""
    comptime ELEMENTS_PER_COPY = 16 // size_of[Scalar[Self.cache_t.dtype]]()
    """Stored elements (values or codes) in a 16-byte copy."""
    comptime COPIES = Self.BN * Self.D // Self.ELEMENTS_PER_COPY // Self.THREADS
    """16-byte copies of each of a tile's K and V that one thread makes."""
    comptime ROW_CHUNKS = Self.D // Self.ELEMENTS_PER_COPY
    """16-byte copies of a stored K or V row."""
    comptime LANES_PER_KEY = min(Self.ROW_CHUNKS, 8)
    """Neighbouring lanes that copy one key's row: 128 contiguous bytes per
    copy instruction, a whole cache line (a bfloat16 row's half at head_dim
    128, an 8-bit code row whole), so each copy instruction of a warp asks
    L2 for four whole lines. Four lanes a key asked for eight half lines,
    twice the requests for the same bytes, where the ninth run's profile
    had the bfloat16 decode's L2 80% busy with DRAM at 67%; fewer lanes a
    key also made ptxas spill the float8 decode at three blocks."""
    comptime KEY_CHUNKS = Self.ROW_CHUNKS // Self.LANES_PER_KEY
    """Copies of each of its keys' rows a thread makes."""
    comptime THREAD_KEYS = Self.COPIES // Self.KEY_CHUNKS
    """Keys of a tile whose rows one thread copies (`copy_key`)."""
    comptime TILE = Self.BN * Self.D
    comptime STAGES_AT = Self.ROWS * Self.D
    """Where the stages start, in bfloat16 elements."""
    comptime CODE_STAGE = 2 * Self.TILE + 2 * Self.BN * Self.STAGED_SCALES * 4 if Self.QUANTIZED else 0
    """Bytes of an 8-bit cache's code stage: K and V codes `[BN, D]`
    (`code_chunk`), then their keys' scales `[BN, STAGED_SCALES]` each."""
    comptime CODES_AT = Self.STAGES_AT + Self.VALUE_STAGES * 2 * Self.TILE
    """Where the code stages start, in bfloat16 elements."""
    comptime STAGES_BYTES = Self.VALUE_STAGES * 2 * Self.TILE * 2 + Self.stage_count * Self.CODE_STAGE
    """Bytes of all stages, which a block may reuse once its tiles are done."""
    comptime ADDRESS_KINDS = 0 if not Self.located else (2 if Self.QUANTIZED else 1)
    """Addresses per key: its row, and an 8-bit cache's key scales (none
    unless `located`)."""
    comptime ADDRESSES_AT = Self.STAGES_AT + Self.STAGES_BYTES // 2
    comptime KEY_SCALES_AT = (
        Self.ADDRESSES_AT * 2 + Self.stage_count * Self.ADDRESS_KINDS * Self.BN * size_of[Int]()
    )
    """Bytes to the widened tile's keys' scales `[2, BN]` (`key_scales`)
    where `scales_per_key` (none `IN_REGISTERS`, which reads them from the
    code stage)."""
    comptime ROW_SCALES_AT = Self.KEY_SCALES_AT + (0 if Self.IN_REGISTERS else 2 * Self.BN * 4)
    """Bytes to the query rows' powers of two `[ROWS]` (`row_scales`) where
    `scales_per_key`."""
    comptime SHARED_BYTES = Self.ROW_SCALES_AT + Self.ROWS * 4 if Self.scales_per_key else (
        Self.KEY_SCALES_AT
    )

    var shared: SharedMemory
    """The block's shared memory (`smem`), as the copies take it too
    (`..copy.start_copy`)."""
    var first_key: Int
    var value_offset: Int
    """Stored elements from a token's key row to its value row: the cache's
    K and V of one layer are one block tensor's `kv_idx` 0 and 1, a fixed
    distance apart for every token (both layouts), so only keys are looked
    up in the page table (and their scales, for an 8-bit cache)."""
    var scale_value_offset: Int
    """An 8-bit cache: scales from a token's key scales to its value
    scales, fixed as `value_offset` is."""

    @staticmethod
    def of(
        args: AttentionArgs[Self.cache_t, DType.bfloat16], work: BlockWork, shared: F32Ptr
    ) -> Self:
        comptime assert (
            Self.cache_t.dtype == DType.bfloat16 or Self.QUANTIZED
        ), "tensor-core tiles are bfloat16, stored so or as 8-bit codes"
        comptime assert (
            Self.QUANTIZED or not Self.scales_per_key
        ), "scales per key are an 8-bit cache's"
        comptime assert Self.D % SWIZZLE_COLUMNS == 0, "tiles are whole swizzled column blocks"
        comptime assert (
            Self.STAGES_AT * 2 % SWIZZLE_ALIGNMENT == 0 and Self.TILE * 2 % SWIZZLE_ALIGNMENT == 0
        ), "every tile starts where the swizzle pattern does"
        comptime assert (
            Self.COPIES * Self.THREADS * Self.ELEMENTS_PER_COPY == Self.BN * Self.D
            and Self.THREAD_KEYS * Self.KEY_CHUNKS == Self.COPIES
            and Self.THREAD_KEYS * (WARP // Self.LANES_PER_KEY) * (Self.THREADS // WARP) == Self.BN
        ), "copy layout"
        comptime assert (
            Self.TILES_AHEAD >= 1
        ), "a tile's copies overlap the previous tile's products"
        comptime assert Self.per_warp or not Self.warp_heads, "a warp's head is its own keys"
        comptime assert not Self.warp_heads or (
            Self.ROWS == Self.HEAD_ROWS * (Self.THREADS // WARP)
        ), "each warp's head's rows"
        var value_offset = 0
        var scale_value_offset = 0
        if not work.empty():
            value_offset = (
                Int(args.v_cache.row_ptr(work.row, 0)) - Int(args.k_cache.row_ptr(work.row, 0))
            ) // size_of[Scalar[Self.cache_t.dtype]]()
            comptime if Self.QUANTIZED:
                scale_value_offset = (
                    Int(args.v_cache.scale_row(work.row, 0))
                    - Int(args.k_cache.scale_row(work.row, 0))
                ) // size_of[Float32]()
        return Self(
            SharedMemory.of(shared.unsafe_bitcast[UInt8]()),
            work.kv_start,
            value_offset,
            scale_value_offset,
        )

    @staticmethod
    def query_dim(column: Int) -> Int:
        """`IN_REGISTERS`: the dim of the queries in column `column` of the
        query tile. Lane t of a score product reads bytes `t * D / 4 ..` of
        its key's row, four codes per k-step
        (`..mma_products.WarpProducts.code_scores`), which the product
        takes as k-columns 2t, 2t + 1, 2t + 8, 2t + 9: the
        queries' columns are ordered alike, and a dot product does not
        depend on the order of its terms."""
        var k_step = column // 16
        var k = column % 16
        return k % 8 // 2 * (Self.D // 4) + 4 * k_step + k // 8 * 2 + k % 2

    @always_inline
    def queries(self) -> BF16Ptr:
        return self.smem()

    @always_inline
    def query_memory(self) -> SharedMemory:
        """`queries` with its shared-memory address, as `wgmma` takes it."""
        return self.shared

    @always_inline
    def stage(self, kv_start: Int) -> Int:
        """The stage of the tile at `kv_start`."""
        return ring_stage[Self.STEP, Self.stage_count](self.first_key, kv_start)

    @always_inline
    def smem(self) -> BF16Ptr:
        """The block's shared memory, in bfloat16 elements."""
        return self.shared.generic.unsafe_bitcast[BFloat16]()

    @always_inline
    def at[T: AnyType](self, offset: Int) -> Pointer[T, MutUntrackedOrigin]:
        """`offset` bytes into the block's shared memory."""
        return self.shared.generic.unsafe_offset(offset).unsafe_bitcast[T]()

    @always_inline
    def tile_offset(self, kv_start: Int, kind: Int) -> Int:
        """Bytes to the bfloat16 K (`kind` KEYS) or V tile of the tile at
        `kv_start` (the one bfloat16 stage for an 8-bit cache)."""
        var stage = 0 if Self.QUANTIZED else self.stage(kv_start)
        return 2 * (Self.STAGES_AT + (stage * 2 + kind) * Self.TILE)

    @always_inline
    def tile(self, kv_start: Int, kind: Int) -> BF16Ptr:
        """The bfloat16 K (`kind` KEYS) or V tile of the tile at `kv_start`."""
        return self.at[BFloat16](self.tile_offset(kv_start, kind))

    @always_inline
    def tile_memory(self, kv_start: Int, kind: Int) -> SharedMemory:
        """`tile` with its shared-memory address, as `wgmma` takes it."""
        return self.shared.at(self.tile_offset(kv_start, kind))

    @always_inline
    def code_stage_offset(self, kv_start: Int) -> Int:
        """An 8-bit cache: bytes to the code stage of the tile at `kv_start`."""
        return 2 * Self.CODES_AT + self.stage(kv_start) * Self.CODE_STAGE

    @always_inline
    def codes_offset(self, kv_start: Int, kind: Int) -> Int:
        """An 8-bit cache: bytes to the K (`kind` KEYS) or V codes `[BN, D]`
        of the tile at `kv_start`, in its code stage (`code_chunk`)."""
        return self.code_stage_offset(kv_start) + kind * Self.TILE

    @always_inline
    def code_tile(self, kv_start: Int, kind: Int) -> BytePtr:
        """`IN_REGISTERS`: the K (`kind` KEYS) or V codes `[BN, D]` of the
        tile at `kv_start` (`code_chunk`), which the products read."""
        return self.at[UInt8](self.codes_offset(kv_start, kind))

    @always_inline
    def scales_offset(self, kv_start: Int, kind: Int) -> Int:
        """An 8-bit cache: bytes to the K (`kind` KEYS) or V scales `[BN,
        STAGED_SCALES]` of the keys of the tile at `kv_start`."""
        return (
            self.code_stage_offset(kv_start)
            + 2 * Self.TILE
            + kind * Self.BN * Self.STAGED_SCALES * 4
        )

    @always_inline
    def scales(self, kv_start: Int, kind: Int) -> F32Ptr:
        """An 8-bit cache: the K (`kind` KEYS) or V scales of the tile at
        `kv_start` (`scales_offset`)."""
        return self.at[Float32](self.scales_offset(kv_start, kind))

    @always_inline
    def addresses(self, kv_start: Int, kind: Int = KEYS) -> Pointer[Int, MutUntrackedOrigin]:
        """The key row addresses (`kind` KEYS), or an 8-bit cache's key
        scale rows' (KEY_SCALES), of the tile at `kv_start`."""
        return (
            self.smem()
            .unsafe_offset(Self.ADDRESSES_AT)
            .unsafe_bitcast[Int]()
            .unsafe_offset((self.stage(kv_start) * Self.ADDRESS_KINDS + kind) * Self.BN)
        )

    @always_inline
    def key_scales(self, kv_start: Int, kind: Int) -> F32Ptr:
        """`scales_per_key`: the keys' key scales (`kind` KEYS), which their
        scores are multiplied by, or their value scales (VALUES), whose
        `value_log_scales` their log-weights add, of the tile at `kv_start`:
        as `convert_tile` leaves them for the widened tile (value scales
        already logged), or `IN_REGISTERS` in the tile's code stage, as
        copied (`scales`)."""
        comptime if Self.IN_REGISTERS:
            return self.scales(kv_start, kind)
        return self.at[Float32](Self.KEY_SCALES_AT + kind * Self.BN * 4)

    @always_inline
    def row_scales(self) -> F32Ptr:
        """`scales_per_key`: each query row's power of two, by which the
        row's float16 queries were divided (`load_queries`)."""
        return self.at[Float32](Self.ROW_SCALES_AT)

    @always_inline
    def stages(self) -> F32Ptr:
        """The stages as float32 words, for what a block leaves there once
        its last tile is done."""
        return self.smem().unsafe_offset(Self.STAGES_AT).unsafe_bitcast[Float32]()

    @always_inline
    def load_queries[
        lanes: Int
    ](self, args: AttentionArgs[Self.cache_t, DType.bfloat16], work: BlockWork, tid: Int):
        """The block's query rows, swizzled (zero rows past the block's);
        threads `tid ..< tid + lanes` take their share (`warp_heads`: of
        their warp's `HEAD_ROWS`, from `work`'s head). `scales_per_key`:
        as float16, each row times a power of two that brings its largest
        value into [2^14, 2^15) (the float16 range holds it, and every
        bfloat16 within 2^-28 of it exactly), and that power's inverse in
        `row_scales`."""
        comptime if Self.scales_per_key:
            self.load_float16_queries[lanes](args, work, tid)
            return
        comptime threads = WARP if Self.warp_heads else Self.THREADS
        var rows = work.rows(args.group)
        var first = head_first_row[Self.warp_heads](tid)
        for l in range(lanes):
            for u in range(tid % threads + l, Self.HEAD_ROWS * Self.CHUNKS, threads):
                var r = u // Self.CHUNKS
                var c = u % Self.CHUNKS
                var to = self.smem().unsafe_offset(swizzled[Self.ROWS](first + r, c))
                if r < rows:
                    var offset = row_offset[Self.D](args, work, r) + c * 8
                    to.unsafe_store[alignment=16](
                        0, rebind[BF16Ptr](args.q).unsafe_load[width=8, alignment=16](offset)
                    )
                else:
                    zero_16(to)

    @always_inline
    def load_float16_queries[
        lanes: Int
    ](self, args: AttentionArgs[Self.cache_t, DType.bfloat16], work: BlockWork, tid: Int):
        """`load_queries` where `scales_per_key`: thread r (of the warp, with
        `warp_heads`) takes row r whole, reading it twice (for its largest
        value, then to convert it) so that no register holds more than a
        chunk; `IN_REGISTERS`, its columns in `query_dim`'s order."""
        comptime threads = WARP if Self.warp_heads else Self.THREADS
        var rows = work.rows(args.group)
        var first_row = head_first_row[Self.warp_heads](tid)
        for l in range(lanes):
            var r = tid % threads + l
            if r >= Self.HEAD_ROWS:
                continue
            var queries = rebind[BF16Ptr](args.q).unsafe_offset(
                row_offset[Self.D](args, work, r) if r < rows else 0
            )
            var largest: Float32 = 0
            if r < rows:
                for c in range(Self.CHUNKS):
                    var chunk = queries.unsafe_load[width=8, alignment=16](c * 8)
                    largest = max(largest, abs(chunk.cast[DType.float32]()).reduce_max())
            # 2^up for the largest's exponent e: up = 14 - e, so that 2^-up
            # stays a normal float32.
            var exponent = Int32(bitcast[DType.uint32](largest) >> 23) - 127
            var up = min(14 - exponent, 126)
            var times = bitcast[DType.float32](UInt32(up + 127) << 23)
            for c in range(Self.CHUNKS):
                var halves = SIMD[DType.float16, 8](0)
                if r < rows:
                    var chunk = SIMD[DType.bfloat16, 8](0)
                    comptime if Self.IN_REGISTERS:
                        comptime for pair in range(4):
                            var dim = Self.query_dim(c * 8 + 2 * pair)
                            var two = queries.unsafe_load[width=2, alignment=4](dim)
                            chunk[2 * pair] = two[0]
                            chunk[2 * pair + 1] = two[1]
                    else:
                        chunk = queries.unsafe_load[width=8, alignment=16](c * 8)
                    halves = (chunk.cast[DType.float32]() * times).cast[DType.float16]()
                self.smem().unsafe_offset(swizzled[Self.ROWS](first_row + r, c)).unsafe_store[
                    alignment=16
                ](0, bitcast[DType.bfloat16, 8](halves))
            self.row_scales()[unsafe_offset=first_row + r] = bitcast[DType.float32](
                UInt32(127 - up) << 23
            )

    @staticmethod
    def key_position(key: Int) -> Int:
        """Where row `key` of a tile lies in the context, from the tile's
        first position: with `warp_heads` each warp's `WARP_KEYS` rows are
        its own head's first positions of the tile."""
        return key % Self.WARP_KEYS if Self.warp_heads else key

    @always_inline
    def locate_rows[
        lanes: Int
    ](
        self,
        args: AttentionArgs[Self.cache_t, DType.bfloat16],
        work: BlockWork,
        tid: Int,
        kv_start: Int,
    ):
        """`locate_pages` of the tile at `kv_start` from its page table
        entries read now (the block's first tiles)."""
        self.locate_pages[lanes](
            args, work, tid, kv_start, self.fetch_pages[lanes](args, work, tid, kv_start)
        )

    @always_inline
    def fetch_pages[
        lanes: Int
    ](
        self,
        args: AttentionArgs[Self.cache_t, DType.bfloat16],
        work: BlockWork,
        tid: Int,
        kv_start: Int,
    ) -> Array[Int32, lanes]:
        """Thread t's key of the tile at `kv_start` (`located_key`): what the
        page table says of it (`..rows.table_page`), read now and used a
        tile later (`locate_pages`), so that the read's latency passes while
        the block computes; -1 for a key past the block's range, or where
        the thread locates no key."""
        var pages = Array[Int32, lanes](fill=-1)
        for l in range(lanes):
            var j = Self.located_key(tid + l)
            var pos = kv_start + Self.key_position(j)
            if j >= 0 and pos < work.kv_end:
                pages[l] = table_page(args.k_cache, work.row, pos)
        return pages^

    @always_inline
    def locate_pages[
        lanes: Int
    ](
        self,
        args: AttentionArgs[Self.cache_t, DType.bfloat16],
        work: BlockWork,
        tid: Int,
        kv_start: Int,
        pages: Array[Int32, lanes],
    ):
        """Thread t, for its key j (`located_key`) of the tile at `kv_start`,
        whose page table entry `pages` holds (`fetch_pages`): the address of
        the key's row in `work`'s KV head (0 where the entry is no page
        of the tensor: a bad entry is never followed), and an 8-bit cache's
        address of its key scales there (its value scales are
        `scale_value_offset` further)."""
        for l in range(lanes):
            var j = Self.located_key(tid + l)
            if j >= 0:
                var pos = kv_start + Self.key_position(j)
                var address = Self.key_row(args, work, pages[l], pos)
                self.addresses(kv_start)[unsafe_offset=j] = address
                comptime if Self.QUANTIZED:
                    var k_scales = 0
                    if address != 0:
                        k_scales = Int(
                            head_scales_in_page(args.k_cache, Int(pages[l]), pos, work.kv_head)
                        )
                    self.addresses(kv_start, KEY_SCALES)[unsafe_offset=j] = k_scales

    @staticmethod
    @always_inline
    def key_row(
        args: AttentionArgs[Self.cache_t, DType.bfloat16], work: BlockWork, page: Int32, pos: Int
    ) -> Int:
        """The address of key `pos`'s row in `work`'s KV head, in `page`
        (its page table entry), or 0 where that is no page of the tensor: a
        bad entry is never followed."""
        var row = row_in_table_page(args.k_cache, page, pos)
        if row == 0:
            return 0
        return Int(
            CachePtr[Self.cache_t.dtype](unsafe_from_address=row).unsafe_offset(
                work.kv_head * Self.D
            )
        )

    @staticmethod
    def located_key(thread: Int) -> Int:
        """The key of a tile that `thread` looks up, or -1: thread j < BN,
        or with `per_warp` lane j < WARP_KEYS of warp w key `w * WARP_KEYS
        + j`."""
        comptime if Self.per_warp:
            var lane = thread % WARP
            return thread // WARP * Self.WARP_KEYS + lane if lane < Self.WARP_KEYS else -1
        else:
            return thread if thread < Self.BN else -1

    @staticmethod
    def copy_key(thread: Int, i: Int) -> Int:
        """The key (row of the tile) of `thread`'s copies `i * KEY_CHUNKS ..<
        (i + 1) * KEY_CHUNKS`: each group of `LANES_PER_KEY` lanes copies
        one key's row at a time, so a thread looks up `THREAD_KEYS`
        addresses a tile, not one per copy; with `per_warp`, keys of its
        warp's share only."""
        comptime if Self.per_warp:
            comptime warp_at_once = WARP // Self.LANES_PER_KEY
            return (
                thread // WARP * Self.WARP_KEYS
                + thread % WARP // Self.LANES_PER_KEY
                + i * warp_at_once
            )
        else:
            return thread // Self.LANES_PER_KEY + i * (Self.THREADS // Self.LANES_PER_KEY)

    @staticmethod
    def copy_first(thread: Int, j: Int) -> Int:
        """The first element of its key's row that `thread`'s copy `j` (of
        `KEY_CHUNKS`) of the row reads: the lanes of a key read neighbouring
        16-byte chunks."""
        return (thread % Self.LANES_PER_KEY + j * Self.LANES_PER_KEY) * Self.ELEMENTS_PER_COPY

    @always_inline
    def copy_offset(self, kv_start: Int, key: Int, first: Int, kind: Int) -> Int:
        """Bytes to where the copy of row `key`'s elements `first ..` of the
        tile's K (`kind` KEYS) or V lands: its swizzled bfloat16 stage, or
        an 8-bit cache's codes `[BN, D]` (offsets, not pointers:
        `..copy.start_copy`)."""
        comptime if Self.QUANTIZED:
            return self.codes_offset(kv_start, kind) + code_chunk[Self.D](key, first // 16)
        else:
            return self.tile_offset(kv_start, kind) + 2 * swizzled[Self.BN](key, first // 8)

    @always_inline
    def start_tile[lanes: Int](self, tid: Int, kv_start: Int, granularity: Int):
        """Starts copying the K and V rows of the tile at `kv_start` as
        stored into its stage, or an 8-bit cache's codes and their keys'
        scales (granules of `granularity` elements) into its code stage
        (zeros for keys without an address), as one committed group."""
        var addresses = self.addresses(kv_start)
        for l in range(lanes):
            comptime for i in range(Self.THREAD_KEYS):
                var key = Self.copy_key(tid + l, i)
                self.start_rows(tid + l, kv_start, key, addresses[unsafe_offset=key])
            comptime if Self.QUANTIZED:
                self.start_scales(tid + l, kv_start, Self.D // granularity)
        commit_copies()

    @always_inline
    def start_rows(self, thread: Int, kv_start: Int, key: Int, address: Int):
        """Starts `thread`'s copies of row `key` of the tile at `kv_start`,
        K and V, from the key row at `address` (zeros where it is 0).

        A bfloat16 tile's copies fill zeros themselves (`start_copy_or_zeros`):
        10 to 56 instructions fewer a tile than a copy and a store of zeros,
        each under its own predicate (the decode's loop 362 to 312 at
        head_dim 128). An 8-bit tile's keep both: the float8 decode, three
        blocks a multiprocessor at head_dim 128, has no register to spare,
        and the zero-filling copies spilled one there."""
        var source = CachePtr[Self.cache_t.dtype](unsafe_from_address=address)
        comptime for j in range(Self.KEY_CHUNKS):
            var first = Self.copy_first(thread, j)
            var keys = self.copy_offset(kv_start, key, first, KEYS)
            var values = self.copy_offset(kv_start, key, first, VALUES)
            var value_source = source.unsafe_offset(self.value_offset + first)
            comptime if not Self.QUANTIZED:
                start_copy_or_zeros(source.unsafe_offset(first), self.shared, keys, address != 0)
                start_copy_or_zeros(value_source, self.shared, values, address != 0)
            else:
                if address != 0:
                    start_copy[16](source.unsafe_offset(first), self.shared, keys)
                    start_copy[16](value_source, self.shared, values)
                else:
                    zero_16(self.at[UInt8](keys))
                    zero_16(self.at[UInt8](values))

    @always_inline
    def start_tile_through_table[
        lanes: Int
    ](
        self,
        args: AttentionArgs[Self.cache_t, DType.bfloat16],
        work: BlockWork,
        tid: Int,
        kv_start: Int,
    ):
        """`start_tile` for threads that look their keys up themselves (a
        producer warpgroup, `..mma.MmaThread.producer`): each reads its keys'
        page table entries and starts their rows' copies, with no address
        in shared memory and no barrier between; the caller commits them.
        A bfloat16 cache's.

        A thread's keys of a tile are `step` apart (`copy_key`): where its
        first key's page holds the next ones, as a page of 64 tokens or
        more holds the whole of a 64-key tile aligned to it, their rows
        follow the first's at `step` rows each, and the thread reads the
        table and computes a row's address once a tile, not once a key
        (the producer's copies 301 instructions a tile to 229 at head_dim
        128)."""
        comptime assert not Self.QUANTIZED, "a producer warpgroup copies bfloat16 rows"
        var cache = args.k_cache
        comptime step = Self.copy_key(0, 1) - Self.copy_key(0, 0)
        var step_bytes = step * cache.num_heads() * Self.D * size_of[Scalar[Self.cache_t.dtype]]()
        for l in range(lanes):
            var first = kv_start + Self.copy_key(tid + l, 0)
            var address = 0
            if first < work.kv_end:
                address = Self.key_row(args, work, table_page(cache, work.row, first), first)
            var first_row = cache.token_in_page(first)
            comptime for i in range(Self.THREAD_KEYS):
                var pos = first + i * step
                comptime if i > 0:
                    if pos >= work.kv_end:
                        address = 0
                    elif address == 0 or first_row + i * step >= cache.page_len():
                        address = Self.key_row(args, work, table_page(cache, work.row, pos), pos)
                    else:
                        address += step_bytes
                self.start_rows(tid + l, kv_start, pos - kv_start, address)

    @always_inline
    def start_scales(self, thread: Int, kv_start: Int, var granules: Int):
        """An 8-bit cache: thread `thread`'s share of the tile's keys'
        scales (`granules` per key) into its code stage: the key or value
        scales of one key (with `per_warp`, of its warp's keys), 4 bytes a
        copy (scale rows are only 4-byte aligned); zeros for keys without
        scales. A thread takes whole keys, so no index divides by the
        granule count, a runtime value (1 where `scales_per_key`, known
        when compiled)."""
        comptime keys = Self.WARP_KEYS if Self.per_warp else Self.BN
        comptime threads = WARP if Self.per_warp else Self.THREADS
        var first_key = thread // WARP * Self.WARP_KEYS if Self.per_warp else 0
        comptime if Self.scales_per_key:
            granules = 1
        for pair in range(thread % threads, 2 * keys, threads):
            var kind = pair // keys
            var key = first_key + pair % keys
            var dest = self.scales_offset(kv_start, kind) + key * Self.STAGED_SCALES * 4
            var address = self.addresses(kv_start, KEY_SCALES)[unsafe_offset=key]
            if address != 0:
                var source = ScalePtr(unsafe_from_address=address).unsafe_offset(
                    kind * self.scale_value_offset
                )
                for granule in range(granules):
                    start_copy[4](source.unsafe_offset(granule), self.shared, dest + 4 * granule)
            else:
                for granule in range(granules):
                    self.at[Float32](dest)[unsafe_offset=granule] = 0

    @always_inline
    def convert_tile[lanes: Int](self, tid: Int, kv_start: Int, granularity: Int):
        """An 8-bit cache: the codes of the tile at `kv_start`, once landed
        with their scales, widened into the one stage, each thread the
        chunks it copied. `scales_per_key` (`granularity` D, the default):
        the codes' own values as float16, exactly (`codes_as_float16`, one
        instruction per pair of float8 codes), and their keys' scales to
        `key_scales` for the products, which take one multiplication per
        score instead of one per code; else bfloat16 of the codes times
        their scale (a 16-code chunk lies in one granule). A key without
        scales becomes zeros."""
        for l in range(lanes):
            comptime for kind in range(2):
                var scales = self.scales(kv_start, kind)
                var tile = self.tile(kv_start, kind)
                comptime for n in range(Self.COPIES):
                    var key = Self.copy_key(tid + l, n // Self.KEY_CHUNKS)
                    var first = Self.copy_first(tid + l, n % Self.KEY_CHUNKS)
                    var codes = self.at[Scalar[Self.cache_t.dtype]](
                        self.copy_offset(kv_start, key, first, kind)
                    ).unsafe_load[width=Self.ELEMENTS_PER_COPY, alignment=16](0)
                    var values: SIMD[DType.bfloat16, Self.ELEMENTS_PER_COPY]
                    comptime if Self.scales_per_key:
                        values = bitcast[DType.bfloat16, Self.ELEMENTS_PER_COPY](
                            codes_as_float16(codes)
                        )
                        if first == 0:
                            var scale = scales[unsafe_offset=key]
                            comptime if kind == VALUES:
                                scale = value_log_scales[1](scale)
                            self.key_scales(kv_start, kind)[unsafe_offset=key] = scale
                    else:
                        var scale = scales[
                            unsafe_offset=key * Self.STAGED_SCALES + first // granularity
                        ]
                        values = as_values(codes, scale).cast[DType.bfloat16]()
                    comptime for half in range(Self.ELEMENTS_PER_COPY // 8):
                        tile.unsafe_offset(swizzled[Self.BN](key, first // 8 + half)).unsafe_store[
                            alignment=16
                        ](0, values.slice[8, offset=half * 8]())

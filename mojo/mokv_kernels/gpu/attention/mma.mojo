"""Attention tiles on tensor cores, for bfloat16 caches and 8-bit caches (their
codes widened in shared memory, `mma_tiles`: times their scales to bfloat16,
or with one scale per head row, the default, as they are to float16 for
float16 products, `scales_per_key` in `MmaThread`, which decode widens in
registers instead, `MmaTiles.IN_REGISTERS`): Q Kᵀ and P V as
`mma.sync` m16n8k16 products with float32 accumulation (`..warp`), or as
Hopper's warpgroup products, in three kernels (`mma_kernel.MmaKernel`,
which orders this program's phases) that differ in what their four warps
split and how they multiply:

- prefill (`decode` False): 64 query rows (tokens times the GQA group of one
  KV head, `work`), sixteen per warp, each warp over all keys of a tile, so
  each K/V tile is read once for the whole group;
- decode (`decode` True): up to 16 query rows, the same in every warp, each
  warp over its own 16 keys of a tile with its own online softmax; at the
  end the warps' states are combined through shared memory (a split-K of
  the tile across warps), so K and V are still read once per group, with
  no tensor-core work on rows that do not exist;
- decode with one KV head a warp (`warp_heads`, `MOKV_DECODE_KERNEL=warp_heads`,
  not yet run on a GPU): a block takes four neighbouring KV heads (eight
  with `block_heads` 8, `=warp_heads_8`: Llama's tokens' whole rows), each
  warp one, over the same 16 positions a tile, so the block's copies of a
  tile read neighbouring rows of each of its tokens (1 KB of Llama's in
  bfloat16) where a block of one head reads a 256-byte row of each, and the
  warps' states are each their own head's, written with no combining. The
  tenth run's decodes all moved about 10^10 rows a second, 256-byte or
  128-byte, at any batch: the rows' count, not their bytes, looked like
  the bound (docs/gpu-kernels.md);
- prefill on Hopper's warpgroup products (`warpgroup` True, the default
  over a bfloat16 cache on Hopper, `op`): two warpgroups of four warps, 128
  query rows, the same tiles, masking and softmax as the prefill, but each
  product is one `wgmma` of a warpgroup (`..warpgroup`): Q Kᵀ with queries
  and keys read by the tensor cores from shared memory, P V with P from
  registers and values from shared memory. A tile is read from shared
  memory once per warpgroup, not once per warp, and copied in once per 128
  rows. Over a bfloat16 cache the next tile's Q Kᵀ is started before this
  tile's softmax (`PIPELINED`), so the tensor cores and the threads work
  at once;
- the same warpgroup prefill fed by a producer (`producer`, over a bfloat16
  cache, `MOKV_PREFILL_KERNEL=wgmma_producer`, not yet timed on a GPU): a
  third warpgroup looks the keys up and copies every tile, and hands each
  stage to the two multiplying warpgroups through shared-memory barriers
  (`..producer`: full when its copies have landed, empty when both
  warpgroups are done with it), so the consumers issue no copy and no
  address arithmetic (478 instructions a tile at head_dim 128 where the
  pipelined kernel issues 595) and wait at no block barrier between tiles:
  each warpgroup runs as far ahead as its tiles have landed. `setmaxnreg`
  moves registers from the producer (64 a thread) to the consumers (216).
  The consumers keep FlashAttention-3's order within a warpgroup
  (`produced_tile`): a tile's Q Kᵀ and the last tile's P V are issued
  together and the tile's softmax runs while that P V does, so only one
  tile's scores are ever live; and its two warpgroups take turns issuing
  them (`take_turn`, FlashAttention-3's ping-pong);
- the same with the producer's copies made by the tensor memory
  accelerator (`boxes`, `MOKV_PREFILL_KERNEL=wgmma_tma`, not yet run on a
  GPU): one warp of the producer warpgroup starts each tile as a few
  tensor-map boxes (`..tensor_map`: 16 keys of one page, K or V, 64
  columns; a row box each for keys that are not such a chunk, zeros past
  the block's last key), and the copy engine completes the stage's full
  barrier as the bytes land: no producer thread copies, waits for copies
  or fences, and the producer runs as far ahead as the stages let it. Its
  tiles are 128 keys (`MmaThread.BN`), three stages of them at head_dim 128.

The context is walked in tiles of `BN` = 64 keys (128 with `boxes`):

- copies: K and V rows of a tile go through the page table row by row, in
  16-byte `cp.async` chunks into swizzled shared memory (`mma_tiles`); two
  stages, the next tile's copies in flight while this one computes (four
  on warpgroup products over a bfloat16 cache: two tiles' copies beside
  the two tiles multiplied); an
  8-bit cache's codes and scales land in code stages (two, three for
  decode), all of them in flight while the widened tile is multiplied
  (a decode widening in registers reads its codes from their stage: it
  keeps four, so three are in flight); a
  key's page table entry is read one tile before its row is located, so
  the block never waits on that read (the copies wait on the address);
- scores (`mma_products`): query and K fragments from `ldmatrix` (the
  queries stay in shared memory, read again per tile: registers go to the
  outputs); the products are scaled by `scale * log2(e)` in float32 inside
  the softmax's exponents (a row's max is taken before, one multiply-add
  per score), so the queries stay exact (with `scales_per_key`, after the
  product, by that times the row's power of two and each key's key scale);
- online softmax in registers (`mma_softmax`): each lane holds two rows'
  scores (decode, with at most 8 rows, only the first's are real);
- values (`mma_products`): the probabilities (with `scales_per_key`, the
  weights: each times its key's value scale) are rounded to bfloat16
  (float16) in registers and are the next product's A operand as they
  are, V fragments from the transposed `ldmatrix`;
- decode over an 8-bit cache with one scale per head row (`IN_REGISTERS`):
  K and V fragments are the codes themselves, widened in registers from
  their code stage (`mma_products`), with no widened tile in shared
  memory; the outputs' columns come out permuted
  (`mma_outputs.output_dim`) and are put back as they are written;
- masking only on tiles some row does not see whole (`mma_mask`);
- the end: each warp writes its rows, or a decode block's warps combine
  their states (`mma_outputs`).

One barrier per tile (none with `producer`, above): after it, this tile's
copies have landed in every thread and every warp is done with the previous
tile, whose stage the next tile's copies then overwrite (an 8-bit cache's
tiles widened in shared memory take a second one, after their codes are
widened into the stage). One more after the first tiles' copies start: an
8-bit cache's first tile shares its address slot with the tile located
next, so no thread may overwrite it while another still reads it. In decode
these are warp barriers, not the block's: each warp locates, copies and
reads only its own keys of a tile (`per_warp` in `mma_tiles`), so its four
warps go through their tiles independently, one waiting on memory while
another computes, until they combine their states. Under the emulator a
program is a whole warp (`..warp`)."""

from ...pointers import F32Ptr
from ...cache.traits import KVCacheT
from ...kv_quantization import is_quantized
from ..block import ThreadProgram
from ..copy import wait_copies
from ..mbarrier import BARRIER_BYTES
from ..warp import MMA_ROWS, WARP, Frags, warp_barrier, warp_uniform, fragment_row
from ..warpgroup import (
    WARPGROUP_WARPS,
    async_proxy_fence,
    warpgroup_commit,
    warpgroup_wait,
    warpgroup_wait_groups,
)
from .config import BLOCK_THREADS, DECODE_ROWS, WARPS
from .mma_mask import VisibleKeys
from .mma_outputs import MmaOutputs
from .mma_products import WarpProducts
from .mma_softmax import RowSoftmax
from .mma_tiles import KEYS, TILE_KEYS, VALUES, MmaTiles, head_first_row, value_log_scales
from .producer import PRODUCER_THREADS, StageRing, TileProducer
from .work import AttentionArgs, BlockWork

# Phases of a block (`MmaThread.step`).
comptime LOAD_Q = 0
comptime START_FIRST = 1
comptime WAIT_TILE = 2
comptime COMPUTE_TILE = 3
comptime FINISH = 4
comptime COMBINE = 5
comptime CONVERT_TILE = 6
comptime FIRST_SCORES = 7
comptime PRODUCE = 8


def _stages(
    D: Int,
    decode: Bool,
    pipelined: Bool,
    boxes: Bool,
    codes: Bool,
    scales_per_key: Bool,
    warp_heads: Bool,
    block_heads: Int,
) -> Int:
    """Shared-memory stages of an `MmaThread`'s tiles: as many as its
    blocks per multiprocessor (`mma_kernel.MmaKernel.MIN_BLOCKS`) leave
    room for, since decode blocks wait on memory (the ninth GPU run's
    profile of the bfloat16 decode: warps waiting on L1TEX for 56% of their
    cycles) and more tiles in flight hide more of it."""
    if pipelined:
        # One block a multiprocessor: the tile whose values are multiplied,
        # the next one whose keys are, and two tiles' copies in flight. The
        # `boxes` kernel's 128-key tiles take three at head_dim 128 (224 KB
        # with the queries: one tile's boxes in flight, as many bytes as two).
        return 3 if boxes and D >= 128 else 4
    if decode and codes:
        # An 8-bit decode: codes widened in registers (`scales_per_key`,
        # `MmaTiles.IN_REGISTERS`) are read from their stage, which is busy
        # meanwhile: four stages, three in flight (three float8 blocks a
        # multiprocessor at head_dim 128, 74 KB each; two int8). The tenth
        # run timed the three-stage decode at bfloat16's tiles per second
        # with half the bytes a tile. One KV head a warp in fours has a
        # larger query tile: three at head_dim 128 (61 KB; four took 78).
        # Codes widened in shared memory: three code stages in flight, as
        # many bytes as two bfloat16 tiles.
        if scales_per_key and not (warp_heads and D >= 128 and block_heads == WARPS):
            return 4
        return 3
    # A block of eight KV heads, alone on its multiprocessor, takes the
    # stages three blocks would: two bfloat16 tiles in flight (211 KB at
    # head_dim 128). The rest keep two: one tile computed, one copied.
    return 3 if block_heads > WARPS else 2


struct MmaThread[
    cache_t: KVCacheT,
    D: Int,
    lanes: Int,
    decode: Bool,
    warpgroup: Bool,
    scales_per_key: Bool,
    producer: Bool = False,
    boxes: Bool = False,
    warp_heads: Bool = False,
    block_heads: Int = WARPS,
](ThreadProgram):
    """One thread of a block on a GPU (`lanes` 1), one warp under the
    emulator (`lanes` 32). Shared memory: `MmaTiles`; a decode block's
    warps leave their states over its stages at the end. Registers: the
    warp's output accumulators `[16, D]` (C fragments), and per row the
    running max and this lane's share of the running sum.

    `scales_per_key` (an 8-bit cache with one scale per head row): the
    products are float16, of the codes' own values and the queries scaled
    per row (`MmaTiles`); each score is multiplied back by its row's power
    of two and its key's key scale, and the online softmax runs over
    log-weights, each score plus the base-2 log of its key's value scale:
    the weights it rounds to float16 for P V are then each key's softmax
    weight times its value scale, relative to the largest such product, so
    float16's range holds them whatever the scales are, while the row sums
    add each key's weight alone. On a float8 cache that widens a pair of
    codes in one instruction, where bfloat16 took five.

    `block_heads` (with `warp_heads`): the neighbouring KV heads a decode
    block takes, one a warp, four or eight (`op`'s `MOKV_DECODE_KERNEL`
    values `warp_heads` and `warp_heads_8`); without `warp_heads` a block
    takes one KV head and this stays at its default."""

    comptime CONSUMER_THREADS = WARP * Self.block_heads if Self.warp_heads else (
        BLOCK_THREADS * (2 if Self.warpgroup else 1)
    )
    """Threads of a block that multiply: four warps, or on warpgroup
    products two warpgroups, which share each K/V tile (half the tile reads
    per row); with `warp_heads` a warp for each of its `block_heads` KV
    heads."""
    comptime THREADS = Self.CONSUMER_THREADS + (PRODUCER_THREADS if Self.producer else 0)
    """Threads of a block: with `producer`, a warpgroup more, which copies
    (one warp more would cost as many registers: each of a multiprocessor's
    four schedulers holds a quarter of its registers, and one of them would
    take three warps)."""
    comptime BN = 2 * TILE_KEYS if Self.boxes else (
        TILE_KEYS // WARPS * Self.block_heads if Self.warp_heads else TILE_KEYS
    )
    """Keys of a tile: 128 with `boxes`, whose consumers hold one tile's
    scores at a time (`produced_tile`) and whose producer addresses no
    copies, so a tile's fixed costs (the barrier waits, the products'
    latencies, each row's max and factor) come once per 128 keys, and the
    keys' operand of Q Kᵀ is 128 wide where the queries' is 64; 64 for the
    rest (the pipelined kernel, which keeps two tiles' scores live, spilled
    240 bytes within 240 registers on 128-key tiles); with `warp_heads`
    16 positions of each of its KV heads."""
    comptime ROWS = DECODE_ROWS * Self.block_heads if Self.warp_heads else (
        MMA_ROWS if Self.decode else Self.CONSUMER_THREADS // WARP * MMA_ROWS
    )
    """Query rows of a block: the most query heads per KV head it takes
    (`warp_heads`: each of its `block_heads` KV heads' rows that can be
    real)."""
    comptime WARP_KEYS = Self.Tiles.WARP_KEYS if Self.decode else Self.BN
    """Keys of a tile one warp scores: in decode the ones it copies
    (`per_warp`), so it reads no other warp's."""
    comptime STEP = Self.Tiles.STEP
    """Context positions a tile spans: `BN`, or a warp's keys with
    `warp_heads` (`MmaTiles.STEP`)."""
    comptime KSTEPS = Self.D // 16
    """k-steps of a score product (16 dims each)."""
    comptime DTILES = Self.D // 8
    """Output n-tiles (8 dims each)."""
    comptime NTILES = Self.WARP_KEYS // 8
    """Score n-tiles of a warp (8 keys each)."""
    comptime PRODUCTS = DType.float16 if Self.scales_per_key else DType.bfloat16
    """The tensor-core operands' type."""
    comptime ROW_HALVES = 1 if Self.decode else 2
    """The rows of a lane's values the softmax runs on (`..warp`'s C layout:
    row `g` in values 0 and 1, row `g + 8` in 2 and 3): a decode block has
    at most `DECODE_ROWS` query rows, so rows 8 to 15 are padding there,
    and its softmax, rescaling and state skip them."""
    comptime PIPELINED = Self.warpgroup and not is_quantized[Self.cache_t.dtype]()
    """Warpgroup products over a bfloat16 cache issue the next tile's Q Kᵀ
    before this tile's softmax, so the tensor cores multiply while the
    threads exponentiate (the eighth run's profile: products and softmax
    took turns, each idle while the other ran). An 8-bit cache's next tile
    is not widened yet at that point: its one bfloat16 stage holds this
    tile."""
    comptime STAGES = _stages(
        Self.D,
        Self.decode,
        Self.PIPELINED,
        Self.boxes,
        is_quantized[Self.cache_t.dtype](),
        Self.scales_per_key,
        Self.warp_heads,
        Self.block_heads,
    )
    """Shared-memory stages of K/V tiles (`mma_tiles`; `_stages` says how many)."""
    comptime Softmax = RowSoftmax[
        Self.lanes, Self.NTILES, Self.DTILES, Self.ROW_HALVES, Self.scales_per_key, Self.PRODUCTS
    ]
    comptime Tiles = MmaTiles[
        Self.cache_t,
        Self.D,
        Self.ROWS,
        Self.CONSUMER_THREADS,
        Self.STAGES,
        per_warp=Self.decode,
        scales_per_key=Self.scales_per_key,
        BN=Self.BN,
        located=not Self.boxes,
        warp_heads=Self.warp_heads,
    ]
    comptime BARRIERS_AT = (
        Self.Tiles.SHARED_BYTES + BARRIER_BYTES - 1
    ) // BARRIER_BYTES * BARRIER_BYTES
    """`producer`: bytes to the ring's barriers (`..producer.StageRing`)."""
    comptime Ring = StageRing[Self.STAGES, Self.BN, Self.BARRIERS_AT]
    comptime Producer = TileProducer[
        Self.cache_t,
        Self.D,
        Self.ROWS,
        Self.STAGES,
        Self.BN,
        Self.boxes,
        Self.lanes,
        Self.BARRIERS_AT,
    ]
    comptime SHARED_BYTES = Self.BARRIERS_AT + Self.Ring.BYTES if Self.producer else (
        Self.Tiles.SHARED_BYTES
    )
    comptime UNIFORM_WARPS = 1 if Self.PIPELINED else 0
    """`uniform_warp`'s length. From a warp-uniform warp number ptxas computes
    the `wgmma` prefills' eight query descriptors once a warp before their
    tile loops (14 to 17 instructions fewer a tile at head_dim 128), where
    from the thread's it keeps them per thread and copies each into uniform
    registers at every product. The other kernels hold none: a field of
    every program cost the `mma.sync` decodes up to 35 more and spilled
    four of them."""
    comptime AHEAD = Self.Tiles.TILES_AHEAD
    """Tiles whose copies start before the block multiplies its first."""
    comptime Visible = VisibleKeys[Self.lanes, Self.ROW_HALVES, Self.NTILES, Self.STEP]
    comptime Outputs = MmaOutputs[Self.D, Self.lanes, Self.ROW_HALVES, Self.Tiles.IN_REGISTERS]
    comptime Products = WarpProducts[
        Self.cache_t.dtype,
        Self.D,
        Self.lanes,
        Self.ROWS,
        Self.BN,
        Self.WARP_KEYS,
        Self.PRODUCTS,
        Self.decode,
        Self.warp_heads,
    ]

    var args: AttentionArgs[Self.cache_t, DType.bfloat16]
    var work: BlockWork
    var tid: Int
    """The program's first thread."""
    var uniform_warp: Array[Int, Self.UNIFORM_WARPS]
    """The pipelined kernels: the program's warp as a warp-uniform value
    (`warp_uniform`), taken once, from which its Q Kᵀ finds its warpgroup's
    query rows (`group_scores`)."""
    var tiles: Self.Tiles
    var o: Frags[DType.float32, 4, Self.DTILES, Self.lanes]
    var softmax: Self.Softmax
    """Each lane's rows' running max and sum."""
    var visible: Self.Visible
    """Which keys each lane's rows see (`..mma_mask`)."""
    var pages: Array[Int32, Self.lanes]
    """The page table entry of this thread's key (`MmaTiles.located_key`)
    of the next tile to locate, read a tile before it is used
    (`MmaTiles.fetch_pages`)."""
    var next_scores: Frags[DType.float32, 4, Self.NTILES, Self.lanes]
    """`PIPELINED`: the next tile's Q Kᵀ, in flight until this tile's
    values are multiplied."""
    var last_weights: Self.Softmax.Weights
    """`producer`: the last tile's weights, rounded: the A operand of its
    P V, which the next tile issues beside its own Q Kᵀ (`produced_tile`)."""
    var score_scales: Frags[DType.float32, 4, 1, Self.lanes]
    """`scales_per_key`: what each of a lane's scores is multiplied by
    besides its key's scale: `scale * log2(e)` times its row's power of two
    (`MmaTiles.row_scales`), read once the queries are loaded."""

    def __init__(
        out self,
        args: AttentionArgs[Self.cache_t, DType.bfloat16],
        work: BlockWork,
        tid: Int,
        shared: F32Ptr,
    ):
        comptime assert Self.WARP_KEYS % 16 == 0, "a warp's keys are whole k-steps of P V"
        comptime assert not (
            Self.decode and Self.warpgroup
        ), "a warpgroup product spans the four warps' rows: prefill only"
        comptime assert (
            WARPS * Self.Outputs.STATE_FLOATS * 4 <= Self.Tiles.STAGES_BYTES
        ), "decode states fit the stages"
        comptime assert DECODE_ROWS <= 8, "a decode block's rows are each lane's first row"
        comptime assert not (
            Self.scales_per_key and Self.warpgroup
        ), "float16 products are mma.sync's (warpgroup products take bfloat16 tiles)"
        comptime assert (
            Self.PIPELINED or not Self.producer
        ), "a producer warpgroup feeds the pipelined warpgroup prefill over bfloat16"
        comptime assert Self.producer or not Self.boxes, "boxes are a producer's copies"
        comptime assert Self.decode or not Self.warp_heads, "a warp's own head is decode's"
        comptime assert Self.block_heads == WARPS or (
            Self.warp_heads and Self.block_heads == 2 * WARPS
        ), "a block of one KV head a warp takes four or eight"
        self.args = args
        self.work = work
        self.tid = tid
        self.uniform_warp = Array[Int, Self.UNIFORM_WARPS](fill=0)
        # Only there: a shuffle stays in the code even where nothing reads it.
        comptime if Self.UNIFORM_WARPS == 1:
            self.uniform_warp[0] = warp_uniform(tid // WARP)
        self.tiles = Self.Tiles.of(args, work, shared)
        self.o = Frags[DType.float32, 4, Self.DTILES, Self.lanes](0)
        self.softmax = Self.Softmax()
        self.pages = Array[Int32, Self.lanes](fill=-1)
        self.next_scores = Frags[DType.float32, 4, Self.NTILES, Self.lanes](0)
        self.last_weights = Self.Softmax.Weights(0)
        self.score_scales = Frags[DType.float32, 4, 1, Self.lanes](0)
        self.visible = Self.Visible(args, work, Self.Products.first_row(tid), tid % WARP)

    def warp(self) -> Int:
        """This program's warp (`WarpProducts.warp`)."""
        return self.products().warp()

    @staticmethod
    def lane_row(tid: Int, l: Int, h: Int) -> Int:
        """The query row of lane `l`'s (of the program at thread `tid`)
        fragment values `2 h` and `2 h + 1` (`..warp`'s C layout)."""
        return fragment_row(Self.Products.first_row(tid), tid % WARP + l, h)

    def warp_key(self) -> Int:
        """The warp's first key (row) of a tile (`WarpProducts.warp_key`)."""
        return self.products().warp_key()

    def warp_position(self) -> Int:
        """Where the warp's first key lies from the tile's first position:
        its first key, or with `warp_heads` (its keys its head's) 0."""
        return 0 if Self.warp_heads else self.warp_key()

    @always_inline
    def is_producer(self) -> Bool:
        """`producer`: whether this is a producer warpgroup thread's program."""
        return Self.producer and self.tid >= Self.CONSUMER_THREADS

    @always_inline
    def ring(self) -> Self.Ring:
        """`producer`: the barriers of the block's stages."""
        return Self.Ring(self.tiles.shared, self.tiles.first_key)

    @always_inline
    def producer_thread(self) -> Self.Producer:
        """`producer`: this producer warpgroup thread's program."""
        return Self.Producer(
            self.args,
            self.work,
            self.tid - Self.CONSUMER_THREADS,
            Self.Producer.Tiles(
                self.tiles.shared,
                self.tiles.first_key,
                self.tiles.value_offset,
                self.tiles.scale_value_offset,
            ),
        )

    @always_inline
    def step(mut self, phase: Int, arg: Int):
        comptime if Self.producer:
            if self.is_producer():
                if phase == LOAD_Q:
                    self.producer_thread().setup[Self.CONSUMER_THREADS]()
                elif phase == PRODUCE:
                    self.producer_thread().produce(arg)
                return
            if phase == LOAD_Q:
                self.tiles.load_queries[Self.lanes](self.args, self.work, self.tid)
                self.shared_writes_done()
                return
        if phase == LOAD_Q:
            self.tiles.load_queries[Self.lanes](self.args, self.work, self.tid)
            comptime for t in range(Self.AHEAD):
                if arg + t * Self.STEP < self.work.kv_end:
                    self.tiles.locate_rows[Self.lanes](
                        self.args, self.work, self.tid, arg + t * Self.STEP
                    )
            self.pages = self.tiles.fetch_pages[Self.lanes](
                self.args, self.work, self.tid, arg + Self.AHEAD * Self.STEP
            )
            self.shared_writes_done()
        elif phase == START_FIRST:
            comptime if Self.scales_per_key:
                self.read_score_scales()
            comptime for t in range(Self.AHEAD):
                if arg + t * Self.STEP < self.work.kv_end:
                    self.tiles.start_tile[Self.lanes](
                        self.tid, arg + t * Self.STEP, self.args.granularity
                    )
            self.shared_writes_done()
        elif phase == WAIT_TILE:
            var located = arg + Self.AHEAD * Self.STEP
            if located < self.work.kv_end:
                self.tiles.locate_pages[Self.lanes](
                    self.args, self.work, self.tid, located, self.pages
                )
                self.pages = self.tiles.fetch_pages[Self.lanes](
                    self.args, self.work, self.tid, located + Self.STEP
                )
            self.wait_tile(arg)
            self.shared_writes_done()
        elif phase == CONVERT_TILE:
            self.tiles.convert_tile[Self.lanes](self.tid, arg, self.args.granularity)
            self.shared_writes_done()
        elif phase == COMPUTE_TILE:
            comptime if Self.producer:
                self.produced_tile[first=False](arg)
            else:
                if arg + Self.AHEAD * Self.STEP < self.work.kv_end:
                    self.tiles.start_tile[Self.lanes](
                        self.tid, arg + Self.AHEAD * Self.STEP, self.args.granularity
                    )
                self.compute_tile(arg)
        elif phase == FIRST_SCORES:
            comptime if Self.producer:
                self.produced_tile[first=True](arg)
            else:
                # Waited for at once: products in flight across the branches
                # of the next tile's wait would make ptxas serialize them all
                # (C7518).
                self.start_scores(arg)
                warpgroup_wait()
        elif phase == PRODUCE:
            pass
        elif phase == FINISH:
            comptime if Self.producer:
                # The block's last tile's P V (`arg`: that tile), if it had one.
                if self.work.kv_start < self.work.kv_end:
                    var weights = self.last_weights.copy()
                    self.group_values(weights, arg)
                    warpgroup_wait()
            comptime if Self.decode and not Self.warp_heads:
                Self.Outputs.save_state(
                    Self.Outputs.state(self.tiles.stages(), self.warp()),
                    self.tid % WARP,
                    self.o,
                    self.softmax,
                )
            else:
                Self.Outputs.write_rows(
                    self.args,
                    self.work,
                    Self.Products.first_row(self.tid),
                    self.tid % WARP,
                    self.o,
                    self.softmax,
                )
        else:
            Self.Outputs.combine(self.args, self.work, self.tiles.stages(), self.tid)

    @always_inline
    def read_score_scales(mut self):
        """`score_scales` from the rows' powers of two (`scales_per_key`)."""
        var row_scales = self.tiles.row_scales()
        for l in range(Self.lanes):
            var head_rows = row_scales.unsafe_offset(head_first_row[Self.warp_heads](self.tid))
            var first = head_rows[unsafe_offset=Self.lane_row(self.tid, l, 0)]
            var second: Float32
            comptime if Self.warp_heads:
                second = first  # padding: no such row in the tile
            else:
                second = head_rows[unsafe_offset=Self.lane_row(self.tid, l, 1)]
            self.score_scales[0, l] = (
                SIMD[DType.float32, 4](first, first, second, second) * self.args.scale_log2
            )

    @always_inline
    def wait_tile(self, kv_start: Int):
        """Waits for this thread's copies of the tile at `kv_start`, leaving
        the later tiles' in flight: up to `AHEAD - 1` of them (`AHEAD - 2`
        when `PIPELINED`, whose next copies start after this wait, in the
        previous tile's `COMPUTE_TILE`), one group each, as many as the
        block has after this one."""
        comptime in_flight = Self.AHEAD - 2 if Self.PIPELINED else Self.AHEAD - 1
        # 32-bit (kv_start < kv_end): a 64-bit signed division takes a
        # dozen instructions more on every tile.
        var later = UInt32(self.work.kv_end - kv_start - 1) // UInt32(Self.STEP)
        comptime for pending in reversed(range(1, in_flight + 1)):
            if later >= UInt32(pending):
                wait_copies[pending]()
                return
        wait_copies[0]()

    @always_inline
    def shared_writes_done(self):
        """After this thread's shared-memory writes (queries, addresses,
        copies waited for, widened codes), before other threads read them:
        warpgroup products read through the async proxy, so a fence
        (`..warpgroup`) precedes the block's barrier; a decode warp's lanes
        read only what its lanes wrote (`per_warp`, `mma_tiles`), so a warp
        barrier takes the block's place between tiles."""
        comptime if Self.warpgroup:
            async_proxy_fence()
        comptime if Self.decode:
            warp_barrier[Self.lanes]()

    @always_inline
    def mask(self, kv_start: Int, mut s: Frags[DType.float32, 4, Self.NTILES, Self.lanes]):
        """-inf in place of the scores of keys a row does not see, on a tile
        some row does not see whole (`..mma_mask`)."""
        if not self.visible.whole(kv_start):
            self.visible.mask(kv_start + self.warp_position(), self.tid % WARP, s)

    @always_inline
    def scores(mut self, kv_start: Int) -> Frags[DType.float32, 4, Self.NTILES, Self.lanes]:
        """The warp's 16 rows' scores against its keys of the tile, -inf
        where masked: their base-2 logits over `logit_scale`. `PIPELINED`:
        the products started a tile ago (`start_scores`), and the next
        tile's started in their place."""
        var s = Frags[DType.float32, 4, Self.NTILES, Self.lanes](0)
        comptime if Self.PIPELINED:
            # Landed: the last tile's wait for its values waited for these.
            # Scaled here, as they leave the registers the next products
            # take (kept as they are, they would take a move each).
            for l in range(Self.lanes):
                comptime for n in range(Self.NTILES):
                    s[n, l] = self.next_scores[n, l] * self.args.scale_log2
            var next_start = self.next_tile(kv_start)
            if next_start < self.work.kv_end:
                self.start_scores(next_start)
        elif Self.warpgroup:
            self.group_scores(kv_start, s)
            warpgroup_wait()
        elif Self.Tiles.IN_REGISTERS:
            self.products().code_scores(
                self.tiles.queries(), self.tiles.code_tile(kv_start, KEYS), s
            )
        else:
            self.products().warp_scores(self.tiles.queries(), self.tiles.tile(kv_start, KEYS), s)
        comptime if Self.scales_per_key:
            self.times_key_scales(kv_start, s)
        self.mask(kv_start, s)
        return s^

    @always_inline
    def logit_scale(self) -> Float32:
        """What the scores are multiplied by to be base-2 logits: `scale *
        log2(e)`, or 1 where `scores` scaled them: with `scales_per_key`,
        whose scores took it with their key scales (`times_key_scales`),
        and `PIPELINED` without `producer`, whose scores took it as they
        left the registers of the next products (`scores`)."""
        comptime if Self.scales_per_key or (Self.PIPELINED and not Self.producer):
            return 1
        return self.args.scale_log2

    @always_inline
    def times_key_scales(
        self, kv_start: Int, mut s: Frags[DType.float32, 4, Self.NTILES, Self.lanes]
    ):
        """`scales_per_key`: each score times its key's key scale and its
        `score_scales`."""
        var scales = self.key_pairs[KEYS](kv_start)
        for l in range(Self.lanes):
            comptime for n in range(Self.NTILES):
                var pair = scales[n, l]
                s[n, l] = s[n, l] * pair.join(pair) * self.score_scales[0, l]

    @always_inline
    def key_pairs[
        kind: Int
    ](self, kv_start: Int) -> Frags[DType.float32, 2, Self.NTILES, Self.lanes]:
        """`scales_per_key`: each lane's keys' key scales (`kind` KEYS) or
        value log-scales (`MmaTiles.key_scales`), a pair per score n-tile:
        lane l's values 2 h + e of n-tile n are key `8 n + 2 (l % 4) + e`
        of the warp's keys, for either row h. `IN_REGISTERS`: value scales
        logged here (a lane's four keys), as copied to the code stage."""
        var scales = self.tiles.key_scales(kv_start, kind).unsafe_offset(self.warp_key())
        var pairs = Frags[DType.float32, 2, Self.NTILES, Self.lanes](0)
        for l in range(Self.lanes):
            var column = 2 * (self.products().lane(l) % 4)
            comptime for n in range(Self.NTILES):
                var pair = scales.unsafe_load[width=2, alignment=8](n * 8 + column)
                comptime if Self.Tiles.IN_REGISTERS and kind == VALUES:
                    pair = value_log_scales[2](pair)
                pairs[n, l] = pair
        return pairs^

    @always_inline
    def start_scores(mut self, kv_start: Int):
        """`PIPELINED`: starts the warpgroup's Q Kᵀ of the tile at `kv_start`
        into `next_scores`, without waiting for them."""
        var s = Frags[DType.float32, 4, Self.NTILES, Self.lanes](0)
        self.group_scores(kv_start, s)
        self.next_scores = s^

    @always_inline
    def warp_tile(self, kv_start: Int) -> Int:
        """`kv_start`, the tile every lane of the warp multiplies, as a
        warp-uniform value: its distance from the block's first key taken
        from lane 0 (`warp_uniform`). The tile's stage, its barriers and its
        keys' and values' descriptors then come from the uniform datapath;
        from the tile loop's own count ptxas computed them in every thread
        and copied each descriptor into uniform registers, 2 to 19
        instructions more a tile (docs/gpu-kernels.md)."""
        return self.tiles.first_key + warp_uniform(kv_start - self.tiles.first_key)

    @always_inline
    def next_tile(self, kv_start: Int) -> Int:
        """The start of the tile after the one at `kv_start`, written as the
        block's first key plus its distance from it: LLVM then folds that
        tile's stage down to `warp_tile`'s lane-0 distance plus one tile, on
        the uniform datapath. Written `kv_start + BN`, the first key's add
        and subtraction stayed in thread registers, and so did the next
        tile's key descriptors, copied into uniform ones at every product
        (15 `R2UR` more a tile)."""
        var first_key = self.tiles.first_key
        return first_key + (kv_start - first_key + Self.BN)

    @always_inline
    def products(self) -> Self.Products:
        """This warp's products (`..mma_products`)."""
        return Self.Products(self.tid)

    @always_inline
    def group_scores(self, kv_start: Int, mut s: Frags[DType.float32, 4, Self.NTILES, Self.lanes]):
        """Starts the warpgroup's Q Kᵀ of the tile at `kv_start` into `s`
        (zeros), read after `warpgroup_wait`."""
        var warp = self.warp()
        comptime if Self.UNIFORM_WARPS == 1:
            warp = self.uniform_warp[0]
        self.products().group_scores(
            self.tiles.query_memory(), self.tiles.tile_memory(kv_start, KEYS), warp, s
        )

    @always_inline
    def group_values(mut self, p: Self.Softmax.Weights, kv_start: Int):
        """Starts the warpgroup's P V of the tile at `kv_start` from its
        weights `p` into the outputs, without waiting for it."""
        self.products().group_values(p, self.tiles.tile_memory(kv_start, VALUES), self.o)

    @always_inline
    def softmax_tile[
        deferred: Bool
    ](
        mut self, kv_start: Int, mut s: Frags[DType.float32, 4, Self.NTILES, Self.lanes]
    ) -> Self.Softmax.Factors:
        """The online softmax of the tile at `kv_start` over its scores `s`
        (`RowSoftmax.tile`, the outputs rescaled there unless `deferred`),
        with its keys' value log-scales where `scales_per_key`."""
        var log_scales = Frags[DType.float32, 2, Self.NTILES, Self.lanes](0)
        comptime if Self.scales_per_key:
            log_scales = self.key_pairs[VALUES](kv_start)
        return self.softmax.tile[deferred](s, log_scales, self.logit_scale(), self.o)

    @always_inline
    def compute_tile(mut self, tile_start: Int):
        """Scores, the online softmax and the values of the warp's keys of
        the tile at `tile_start`."""
        var kv_start = tile_start
        comptime if Self.PIPELINED:
            kv_start = self.warp_tile(tile_start)
        var s = self.scores(kv_start)
        _ = self.softmax_tile[deferred=False](kv_start, s)
        comptime if Self.warpgroup:
            # Rounded before the products start: conversions between them
            # made ptxas serialize every `wgmma` of the kernel (C7520).
            self.group_values(Self.Softmax.all_weights(s), kv_start)
            warpgroup_wait()
        elif Self.Tiles.IN_REGISTERS:
            var values = self.tiles.code_tile(kv_start, VALUES)
            comptime for j in range(Self.WARP_KEYS // 16):
                self.products().code_values(Self.Softmax.weights(s, j), values, j, self.o)
        else:
            var values = self.tiles.tile(kv_start, VALUES)
            comptime for j in range(Self.WARP_KEYS // 16):
                self.products().warp_values(Self.Softmax.weights(s, j), values, j, self.o)

    @always_inline
    def produced_tile[first: Bool](mut self, tile_start: Int):
        """`producer`: the tile at `tile_start` once it has landed, in
        FlashAttention-3's order within a warpgroup: its Q Kᵀ and the last
        tile's P V (`last_weights`; none for the block's `first`) issued
        together, this tile's softmax while that P V runs, then the outputs
        rescaled, the last tile's stage released, and this tile's weights
        kept for the next. The tensor cores multiply while the threads
        exponentiate, as with `start_scores`, but one tile's scores are live
        where two were: room for the outputs, the scores and the weights of
        longer tiles."""
        var kv_start = self.warp_tile(tile_start)
        var ring = self.ring()
        ring.full(kv_start).wait(ring.use(kv_start))
        self.take_turn(kv_start)
        var s = Frags[DType.float32, 4, Self.NTILES, Self.lanes](0)
        self.group_scores(kv_start, s)
        warpgroup_commit()
        comptime if first:
            self.pass_turn()
            warpgroup_wait_groups[0]()
        else:
            var weights = self.last_weights.copy()
            self.group_values(weights, kv_start - Self.BN)
            warpgroup_commit()
            self.pass_turn()
            warpgroup_wait_groups[1]()
        self.mask(kv_start, s)
        var factors = self.softmax_tile[deferred=True](kv_start, s)
        comptime if not first:
            warpgroup_wait_groups[0]()
            ring.empty(kv_start - Self.BN).arrive[Self.lanes]()
            for l in range(Self.lanes):
                comptime for h in range(Self.ROW_HALVES):
                    var alpha = factors[h, l][0]
                    if alpha != 1:
                        Self.Softmax.rescale(self.o, h, l, alpha)
        self.last_weights = Self.Softmax.all_weights(s)

    @always_inline
    def take_turn(self, kv_start: Int):
        """`producer`: waits for this warpgroup's turn to issue the products
        of the tile at `kv_start`: the second warpgroup's n-th once the first
        has issued its (n - 1)-th tile's, the first's once the second has
        issued the same tile's (FlashAttention-3's ping-pong: each
        warpgroup's products run while the other exponentiates, where two
        warpgroups issuing at once would take turns on the tensor cores
        tile by tile anyway, their softmaxes idling them together). The
        second leads because the emulator runs a block's warps last first."""
        var tile = Int(UInt32(kv_start - self.work.kv_start) // UInt32(Self.BN))
        var group = self.warp() // WARPGROUP_WARPS
        if group == 1:
            if tile > 0:
                self.ring().turn(1).wait(tile - 1)
        else:
            self.ring().turn(0).wait(tile)

    @always_inline
    def pass_turn(self):
        """`producer`: after issuing a tile's products, the other consumer
        warpgroup's turn (`take_turn`)."""
        self.ring().turn(1 - self.warp() // WARPGROUP_WARPS).arrive[Self.lanes]()

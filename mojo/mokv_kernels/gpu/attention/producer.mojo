"""The producer warpgroup of the producer-fed warpgroup prefills
(`..mma.MmaThread.producer`), and the ring of stages through which it
hands tiles to the block's two consumer warpgroups.

The ring (`StageRing`): a block's tiles of `BN` keys take its `STAGES`
shared-memory stages in turn from its first key, and each stage has two
barriers (`..mbarrier`). Its full barrier's phase completes when a tile's K
and V have landed in it: every producer thread arrives once its copies
have (`cp.async`), or, fed by tensor-map boxes (`boxes`), one thread
arrives expecting the tile's bytes and the copy engine counts them off as
the boxes land. Its empty barrier's phase completes when both consumer
warpgroups are done with the tile (every consumer thread arrives). The
n-th tile to take a stage is the n-th phase of its barriers (`use`): the
consumers wait for parity n of its full barrier, the producer for parity
n - 1 of its empty one (the stage's last tile released; none for a stage's
first tile). Two more barriers are the consumer warpgroups' turns to issue
their products (`turn`, `MmaThread.take_turn`).

Registers: after the setup the producer warpgroup gives registers up and
the consumers take them (`setmaxnreg`, `PRODUCER_REGISTERS` and
`CONSUMER_REGISTERS`): the producer only addresses and starts copies."""

from ...cache.traits import KVCacheT
from ..copy import commit_copies, wait_copies
from ..mbarrier import BARRIER_BYTES, SharedBarrier
from ..rows import table_page
from ..tensor_map import CHUNK_ROWS, acquire_maps, start_box
from ..shared_memory import SharedMemory
from ..swizzle import SWIZZLE_BYTES, SWIZZLE_COLUMNS
from ..warpgroup import WARPGROUP_WARPS, async_proxy_fence
from ..warp import WARP
from .mma_tiles import KEYS, MmaTiles, ring_stage
from .work import AttentionArgs, BlockWork

comptime PRODUCER_THREADS = WARPGROUP_WARPS * WARP
"""The producer warpgroup's threads."""
comptime PRODUCER_REGISTERS = 64
"""Registers a producer thread keeps (`setmaxnreg`; 40 spilled, and 56
once its keys of a tile shared their page's address, `MmaTiles.
start_tile_through_table`: 80 bytes over a continuous-batching cache at
head_dim 128)."""
comptime CONSUMER_REGISTERS = 216
"""Registers a consumer thread takes. `setmaxnreg.inc` waits until the
block's pool holds them, and the pool holds only what `setmaxnreg.dec`
released: the producer's 168 - 64 a thread cover the consumers' 2 * (216 -
168), and 224 would need a producer of 56. The consumers' tile loops
compile to the same instructions at 216 as at 224, with no spills."""

comptime PRODUCER_LAG = 2
"""Without `boxes`: tiles the producer warpgroup starts before it hands a
tile over (waits for its copies and arrives on its full barrier): two
groups of copies in flight. With four stages it hands tile t over as it
starts tile t + 2 into the stage of tile t - 2, which the consumers
release once tile t - 1's scores are multiplied beside tile t - 2's values
(`MmaThread.produced_tile`): a tile's copies have the time of a tile to
land before the consumers need them."""

# A ring's barriers: each stage's full, then each stage's empty, then the turns.
comptime _FULL = 0
comptime _EMPTY = 1
comptime _TURN = 2


@fieldwise_init
struct StageRing[STAGES: Int, BN: Int, AT: Int](TrivialRegisterPassable):
    """The barriers of a block's ring of `STAGES` stages of `BN`-key tiles
    from its first key `first_key`, `AT` bytes into shared memory."""

    comptime BYTES = (2 * Self.STAGES + 2) * BARRIER_BYTES

    var shared: SharedMemory
    var first_key: Int

    @always_inline
    def _barrier(self, kind: Int, index: Int) -> SharedBarrier:
        return SharedBarrier(self.shared, Self.AT + (kind * Self.STAGES + index) * BARRIER_BYTES)

    @always_inline
    def use(self, kv_start: Int) -> Int:
        """How many tiles took the stage of the tile at `kv_start` before it,
        whose parity names the phase of its barriers that the tile is."""
        return Int(UInt32(kv_start - self.first_key) // UInt32(Self.BN * Self.STAGES))

    @always_inline
    def full(self, kv_start: Int) -> SharedBarrier:
        """The barrier whose phase completes when the tile at `kv_start` has
        landed in its stage."""
        return self._barrier(_FULL, ring_stage[Self.BN, Self.STAGES](self.first_key, kv_start))

    @always_inline
    def empty(self, kv_start: Int) -> SharedBarrier:
        """The barrier whose phase completes when both consumer warpgroups
        are done with the tile at `kv_start`."""
        return self._barrier(_EMPTY, ring_stage[Self.BN, Self.STAGES](self.first_key, kv_start))

    @always_inline
    def turn(self, group: Int) -> SharedBarrier:
        """Consumer warpgroup `group`'s turn to issue products: a phase each
        time the other warpgroup has issued a tile's."""
        return self._barrier(_TURN, group)

    @always_inline
    def init[full_arrivals: Int, consumer_threads: Int, boxes: Bool](self):
        """Sets the counts of arrivals every barrier's phases take (one
        thread does it, before a block barrier), visible to the copy engine
        too where `boxes` complete the full barriers."""
        comptime for stage in range(Self.STAGES):
            self._barrier(_FULL, stage).init(full_arrivals)
            self._barrier(_EMPTY, stage).init(consumer_threads)
        comptime for group in range(2):
            self.turn(group).init(consumer_threads // 2)
        comptime if boxes:
            self._barrier(_FULL, 0).fence_init()


@fieldwise_init
struct TileProducer[
    cache_t: KVCacheT,
    D: Int,
    ROWS: Int,
    STAGES: Int,
    BN: Int,
    boxes: Bool,
    lanes: Int,
    barriers_at: Int,
](TrivialRegisterPassable):
    """A producer warpgroup thread's program (`lanes` 1; one warp under the
    emulator): `tid` is its thread within the warpgroup. It has no rows: it
    sets the barriers up (`setup`), then starts every tile of the block
    into its stage (`produce`) as the consumers release the stage."""

    comptime Tiles = MmaTiles[
        Self.cache_t,
        Self.D,
        Self.ROWS,
        PRODUCER_THREADS,
        Self.STAGES,
        per_warp=False,
        scales_per_key=False,
        BN=Self.BN,
        located=not Self.boxes,
    ]
    """The consumers' shared memory, its copies shared out among the
    producer warpgroup's threads."""
    comptime Ring = StageRing[Self.STAGES, Self.BN, Self.barriers_at]
    comptime TILE_BYTES = 2 * Self.BN * Self.D * 2
    """`boxes`: bytes of a tile's K and V, what its full barrier expects."""

    var args: AttentionArgs[Self.cache_t, DType.bfloat16]
    var work: BlockWork
    var tid: Int
    var tiles: Self.Tiles

    @always_inline
    def lane(self, l: Int) -> Int:
        return self.tid % WARP + l

    @always_inline
    def ring(self) -> Self.Ring:
        """The barriers of the stages the tiles take."""
        return Self.Ring(self.tiles.shared, self.tiles.first_key)

    @always_inline
    def setup[consumer_threads: Int](self):
        """The ring's barriers (with `boxes`, a full barrier's phase takes one
        arrival, which expects the tile's bytes), and the tensor maps the
        boxes read."""
        if self.tid == 0:
            self.ring().init[1 if Self.boxes else PRODUCER_THREADS, consumer_threads, Self.boxes]()
        comptime if Self.boxes:
            if self.tid < WARP:
                acquire_maps(self.args.page_maps)

    @always_inline
    def produce(self, kv_start: Int):
        """This call's part of the tile at `kv_start` (`start_boxes` or
        `start_copies`)."""
        comptime if Self.boxes:
            self.start_boxes(kv_start)
        else:
            self.start_copies(kv_start)

    @always_inline
    def start_copies(self, kv_start: Int):
        """Without `boxes`: hands over the tile `PRODUCER_LAG` tiles before
        the one at `kv_start` (its copies waited for, made visible to the
        products, its full barrier arrived on), then starts copying the
        tile at `kv_start` once the consumers are done with its stage's last
        tile. Every call commits a group of copies, empty past the block's
        keys, so the count of groups a wait leaves in flight is always the
        lag."""
        comptime assert (
            Self.STAGES - 2 >= PRODUCER_LAG
        ), "the producer's last calls hand the block's last tile over"
        var ready = kv_start - PRODUCER_LAG * Self.BN
        if ready >= self.work.kv_start and ready < self.work.kv_end:
            wait_copies[PRODUCER_LAG - 1]()
            async_proxy_fence()
            self.ring().full(ready).arrive[Self.lanes]()
        if kv_start < self.work.kv_end:
            var use = self.ring().use(kv_start)
            if use > 0:
                self.ring().empty(kv_start).wait(use - 1)
            self.tiles.start_tile_through_table[Self.lanes](
                self.args, self.work, self.tid, kv_start
            )
        commit_copies()

    @always_inline
    def start_boxes(self, kv_start: Int):
        """`boxes`: the first warp starts the tile at `kv_start` once the
        consumers are done with its stage's last tile: lane 0 arrives on
        its full barrier expecting the tile's bytes, then lane c < `BN /
        CHUNK_ROWS` starts the boxes of the tile's keys `CHUNK_ROWS * c ..`
        (`start_chunk`). The copy engine completes the phase as the last
        bytes land; the other producer warps copy nothing."""
        comptime assert Self.BN % CHUNK_ROWS == 0, "a tile is whole chunks of keys"
        if kv_start >= self.work.kv_end or self.tid >= WARP:
            return
        var use = self.ring().use(kv_start)
        if use > 0:
            self.ring().empty(kv_start).wait(use - 1)
        var full = self.ring().full(kv_start)
        var keys_at = self.tiles.tile_offset(kv_start, KEYS)
        for l in range(Self.lanes):
            var lane = self.lane(l)
            if lane == 0:
                full.arrive_expecting(Self.TILE_BYTES)
            if lane < Self.BN // CHUNK_ROWS:
                self.start_chunk(kv_start, lane * CHUNK_ROWS, keys_at, full)

    @always_inline
    def start_chunk(self, kv_start: Int, tile_row: Int, keys_at: Int, full: SharedBarrier):
        """`boxes`: keys `tile_row .. tile_row + CHUNK_ROWS` of the tile at
        `kv_start`, whose K tile is `keys_at` bytes into shared memory, as
        chunk boxes where they lie in one page before the block's last key,
        else as a row box each, with page -1 (zeros) past that key."""
        var cache = self.args.k_cache
        var first = kv_start + tile_row
        var row = cache.token_in_page(first)
        if first + CHUNK_ROWS <= self.work.kv_end and row + CHUNK_ROWS <= cache.page_len():
            self.start_chunk_boxes[CHUNK_ROWS](
                keys_at, tile_row, row, table_page(cache, self.work.row, first), full
            )
            return
        for r in range(CHUNK_ROWS):
            var page: Int32 = -1
            if first + r < self.work.kv_end:
                page = table_page(cache, self.work.row, first + r)
            self.start_chunk_boxes[1](
                keys_at, tile_row + r, cache.token_in_page(first + r), page, full
            )

    @always_inline
    def start_chunk_boxes[
        rows: Int
    ](self, keys_at: Int, tile_row: Int, row: Int, page: Int32, full: SharedBarrier):
        """`boxes`: the K and V boxes of `rows` rows from row `row` of
        `page`, every column block, into rows `tile_row ..` of the K tile
        `keys_at` bytes into shared memory and of its V tile."""
        comptime for kind in range(2):
            comptime for block in range(Self.D // SWIZZLE_COLUMNS):
                start_box[rows](
                    self.args.page_maps,
                    keys_at
                    + kind * Self.Tiles.TILE * 2
                    + (block * Self.BN + tile_row) * SWIZZLE_BYTES,
                    full,
                    block * SWIZZLE_COLUMNS,
                    self.work.kv_head,
                    kind,
                    row,
                    page,
                )

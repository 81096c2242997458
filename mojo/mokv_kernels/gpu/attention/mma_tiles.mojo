"""A tensor-core attention block's shared memory (`mma`), and how the
queries and the K/V tiles get there.

Layout, bfloat16 rows of `D` elements, XOR-swizzled (chunk c of row r at
chunk `c ^ (r % 8)`, so the eight rows one `ldmatrix` reads sit in distinct
banks): the block's queries `[ROWS, D]`, then `STAGES` pairs of K and V
tiles `[BN, D]`, then per stage the `BN` key rows' addresses.

K and V rows of a tile go through the page table row by row: one thread per
key looks its row up once (`locate_rows`) and leaves the address in shared
memory, then every thread copies 16-byte chunks (`start_tile`: thread t
chunks t, t + 128, ..., so a warp reads whole rows) with `cp.async`
(`..copy`), committed as one group per tile."""

from std.sys import size_of

from ...cache.traits import KVCacheT
from ...pointers import BF16Ptr, CachePtr, F32Ptr

from ..copy import commit_copies, start_copy_16, zero_16

from .config import BLOCK_THREADS
from .work import AttentionArgs, BlockWork, row_offset

comptime BN = 64
"""Keys per tile."""
comptime STAGES = 2
comptime KEYS = 0
comptime VALUES = 1


@fieldwise_init
struct MmaTiles[cache_t: KVCacheT, D: Int, ROWS: Int](TrivialRegisterPassable):
    """One block's shared memory, from `smem`; tiles alternate between the
    stages from the block's first key `first_key`."""

    comptime CHUNKS = Self.D // 8
    """16-byte chunks of a row."""
    comptime COPIES = BN * Self.CHUNKS // BLOCK_THREADS
    """Chunks of each of a tile's K and V that one thread copies."""
    comptime TILE = BN * Self.D
    comptime STAGES_AT = Self.ROWS * Self.D
    """Where the stages start, in elements."""
    comptime STAGE_BYTES = STAGES * 2 * Self.TILE * 2
    comptime ADDRESSES_AT = Self.STAGES_AT + STAGES * 2 * Self.TILE
    comptime SHARED_BYTES = Self.ADDRESSES_AT * 2 + STAGES * BN * size_of[Int]()

    var smem: BF16Ptr
    var first_key: Int
    var value_offset: Int
    """Elements from a token's key row to its value row: the cache's K and
    V of one layer are one block tensor's `kv_idx` 0 and 1, a fixed
    distance apart for every token (both layouts), so only keys are looked
    up in the page table and the value cache's state need not stay live."""

    @staticmethod
    def of(
        args: AttentionArgs[Self.cache_t, DType.bfloat16], work: BlockWork, shared: F32Ptr
    ) -> Self:
        comptime assert Self.cache_t.dtype == DType.bfloat16, "tensor-core tiles are bfloat16"
        comptime assert Self.D % 64 == 0, "the swizzle needs rows of 8 chunks or more"
        comptime assert Self.COPIES * BLOCK_THREADS == BN * Self.CHUNKS, "copy layout"
        var value_offset = 0
        if not work.empty():
            value_offset = (
                Int(args.v_cache.row_ptr(work.row, 0)) - Int(args.k_cache.row_ptr(work.row, 0))
            ) // size_of[BFloat16]()
        return Self(shared.unsafe_bitcast[BFloat16](), work.kv_start, value_offset)

    @staticmethod
    def swizzled(row: Int, chunk: Int) -> Int:
        """Element offset of chunk `chunk` of row `row` in a `[*, D]` tile."""
        return row * Self.D + (chunk ^ (row % 8)) * 8

    @always_inline
    def queries(self) -> BF16Ptr:
        return self.smem

    @always_inline
    def stage(self, kv_start: Int) -> Int:
        return (kv_start - self.first_key) // BN % STAGES

    @always_inline
    def tile(self, kv_start: Int, kind: Int) -> BF16Ptr:
        """The K (`kind` KEYS) or V tile of the tile at `kv_start`."""
        return self.smem.unsafe_offset(
            Self.STAGES_AT + (self.stage(kv_start) * 2 + kind) * Self.TILE
        )

    @always_inline
    def addresses(self, kv_start: Int) -> Pointer[Int, MutUntrackedOrigin]:
        """The key row addresses of the tile at `kv_start`."""
        return (
            self.smem.unsafe_offset(Self.ADDRESSES_AT)
            .unsafe_bitcast[Int]()
            .unsafe_offset(self.stage(kv_start) * BN)
        )

    @always_inline
    def stages(self) -> F32Ptr:
        """The stages as float32 words, for what a block leaves there once
        its last tile is done."""
        return self.smem.unsafe_offset(Self.STAGES_AT).unsafe_bitcast[Float32]()

    @always_inline
    def load_queries[
        lanes: Int
    ](self, args: AttentionArgs[Self.cache_t, DType.bfloat16], work: BlockWork, tid: Int):
        """The block's query rows, swizzled (zero rows past the block's);
        threads `tid ..< tid + lanes` take their share."""
        var rows = work.rows(args.group)
        for l in range(lanes):
            for u in range(tid + l, Self.ROWS * Self.CHUNKS, BLOCK_THREADS):
                var r = u // Self.CHUNKS
                var c = u % Self.CHUNKS
                var to = self.smem.unsafe_offset(Self.swizzled(r, c))
                if r < rows:
                    var offset = row_offset[Self.D](args, work, r) + c * 8
                    to.unsafe_store[alignment=16](
                        0, rebind[BF16Ptr](args.q).unsafe_load[width=8, alignment=16](offset)
                    )
                else:
                    zero_16(to)

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
        """Thread j < BN: the address of key `kv_start + j`'s row in the
        block's KV head (0 outside the block's range or the cache)."""
        var head_offset = work.kv_head * Self.D
        for l in range(lanes):
            var j = tid + l
            if j < BN:
                var pos = kv_start + j
                var address = 0
                if args.has_key(work, pos):
                    address = Int(args.k_cache.row_ptr(work.row, pos).unsafe_offset(head_offset))
                self.addresses(kv_start)[unsafe_offset=j] = address

    @always_inline
    def start_tile[lanes: Int](self, tid: Int, kv_start: Int):
        """Starts copying the K and V rows of the tile at `kv_start` into its
        stage (zeros for keys without an address), as one committed group."""
        var keys = rebind[CachePtr[Self.cache_t.dtype]](self.tile(kv_start, KEYS))
        var values = rebind[CachePtr[Self.cache_t.dtype]](self.tile(kv_start, VALUES))
        var addresses = self.addresses(kv_start)
        for l in range(lanes):
            for n in range(Self.COPIES):
                var unit = tid + l + n * BLOCK_THREADS
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

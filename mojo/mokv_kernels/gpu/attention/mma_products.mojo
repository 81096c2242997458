"""A tensor-core warp's products over its block's tiles in shared memory
(`mma_tiles`): Q Kᵀ into its score fragments and P V into its outputs, in
one of three ways (`mma` picks which):

- `mma.sync` m16n8k16 (`warp_scores`, `warp_values`): query and K fragments
  from `ldmatrix`, V fragments from the transposed `ldmatrix`, over the
  swizzled bfloat16 (or float16) tiles;
- over an 8-bit cache's codes in registers (`code_scores`, `code_values`,
  `MmaTiles.IN_REGISTERS`): K and V fragments are the codes themselves,
  loaded 16 bytes at a time from their code stage and converted in
  registers (a pair of float8 codes per instruction). A lane's four codes
  of a k-step are four consecutive dims of its key, and the queries'
  columns are stored in that order (`MmaTiles.query_dim`); a lane's value
  fragment of an n-tile is one byte of each of four value rows, two rows'
  pair of n-tiles one byte permute, and the outputs' columns come out in
  that order (`mma_outputs.output_dim`);
- a warpgroup's `wgmma` (`group_scores`, `group_values`, `..warpgroup`):
  queries and keys read by the tensor cores from shared memory, P from
  registers; started here, waited for by the caller.

The products know where the warp's rows and keys lie in the tiles, nothing
of the block's schedule, stages or masking (`mma.MmaThread`)."""

from std.memory import bitcast

from ...pointers import BF16Ptr, BytePtr
from ..codes import codes_as_float16
from ..shared_memory import SharedMemory
from ..swizzle import swizzled
from ..warp import MMA_ROWS, WARP, FragA, FragB, Frags, each_lane, ld_matrix, mma
from ..warpgroup import (
    WARPGROUP_ROWS,
    WARPGROUP_WARPS,
    k_slice,
    mn_slice,
    warpgroup_arrive,
    wgmma_rs,
    wgmma_ss,
)
from .config import DECODE_ROWS
from .mma_tiles import code_chunk, head_first_row


@fieldwise_init
struct WarpProducts[
    cache_dtype: DType,
    D: Int,
    lanes: Int,
    ROWS: Int,
    BN: Int,
    WARP_KEYS: Int,
    PRODUCTS: DType,
    decode: Bool,
    warp_heads: Bool,
](TrivialRegisterPassable):
    """The products of one warp (`lanes` 1: one thread of it on a GPU; 32:
    the whole warp, emulated) whose query rows start at row `warp_row()` of
    the block's `[ROWS, D]` query tile and whose keys at row `warp_key()` of
    each `[BN, D]` K/V tile, `WARP_KEYS` of them. `PRODUCTS`: the operands'
    type (float16 over an 8-bit cache's codes with one scale per head row,
    else bfloat16). `warp_heads` (a decode): the warp's query rows are its
    own head's `DECODE_ROWS`, its product's rows 8 to 15 padding."""

    comptime KSTEPS = Self.D // 16
    """k-steps of a score product (16 dims each)."""
    comptime DTILES = Self.D // 8
    """Output n-tiles (8 dims each)."""
    comptime NTILES = Self.WARP_KEYS // 8
    """Score n-tiles (8 keys each)."""
    comptime Scores = Frags[DType.float32, 4, Self.NTILES, Self.lanes]
    comptime Outputs = Frags[DType.float32, 4, Self.DTILES, Self.lanes]
    comptime Weights = Frags[DType.bfloat16, 8, Self.NTILES // 2, Self.lanes]

    var tid: Int
    """The program's first thread."""

    def lane(self, l: Int) -> Int:
        """The lane of the program's `l`-th lane in its warp."""
        return self.tid % WARP + l

    def warp(self) -> Int:
        """The warp, within the block."""
        return self.tid // WARP

    @staticmethod
    def first_row(tid: Int) -> Int:
        """The first query row of thread `tid`'s warp's products: 0 in
        decode, whose warps share their rows."""
        return 0 if Self.decode else tid // WARP * MMA_ROWS

    def warp_row(self) -> Int:
        """The warp's first row in the query tile: its products' first row
        plus, with `warp_heads`, its head's first. Computed from `tid` where
        it is used, as `warp_key` is: held in fields, they made LLVM keep
        each k-step's key addresses in registers across the tile loop, and
        the `mma.sync` prefill spilled."""
        return Self.first_row(self.tid) + head_first_row[Self.warp_heads](self.tid)

    def warp_key(self) -> Int:
        """The warp's first key (row) of a tile: in decode the ones it
        copies, so it reads no other warp's; else 0."""
        return self.warp() * Self.WARP_KEYS if Self.decode else 0

    @always_inline
    def query_fragment(self, queries: BF16Ptr, k: Int) -> Array[FragA, Self.lanes]:
        """The A fragment of the warp's query rows for k-step `k` (`ldmatrix`)."""
        var rows = Array[BF16Ptr, Self.lanes](fill=queries)
        for l in range(Self.lanes):
            var lane = self.lane(l)
            # `warp_heads`: rows 8 to 15 of the product are padding, whose
            # weights the softmax zeroes: they read the real rows again.
            var row = self.warp_row() + lane % (DECODE_ROWS if Self.warp_heads else 16)
            rows[l] = queries.unsafe_offset(swizzled[Self.ROWS](row, 2 * k + lane // 16))
        return ld_matrix[4, False, Self.lanes](rows)

    @always_inline
    def warp_scores(self, queries: BF16Ptr, keys: BF16Ptr, mut s: Self.Scores):
        """Q Kᵀ of the warp's rows and keys as `mma.sync` products, query
        and key fragments from `ldmatrix`."""
        comptime for k in range(Self.KSTEPS):
            var a = self.query_fragment(queries, k)
            var rows = Array[BF16Ptr, Self.lanes](fill=keys)
            comptime for n2 in range(Self.NTILES // 2):
                for l in range(Self.lanes):
                    var lane = self.lane(l)
                    var key = self.warp_key() + n2 * 16 + lane // 16 * 8 + lane % 8
                    rows[l] = keys.unsafe_offset(swizzled[Self.BN](key, 2 * k + lane // 8 % 2))
                var b = ld_matrix[4, False, Self.lanes](rows)
                var b0 = Array[FragB, Self.lanes](fill=0)
                var b1 = Array[FragB, Self.lanes](fill=0)
                Self.split_operands(b, b0, b1)
                s.set(2 * n2, mma[Self.lanes, Self.PRODUCTS](a, b0, s.get(2 * n2)))
                s.set(2 * n2 + 1, mma[Self.lanes, Self.PRODUCTS](a, b1, s.get(2 * n2 + 1)))

    @always_inline
    def warp_values(
        self, a: Array[FragA, Self.lanes], values: BF16Ptr, j: Int, mut o: Self.Outputs
    ):
        """P V of the warp's rows over keys 16 j .. of its share of the
        tile as `mma.sync` products, V fragments from the transposed
        `ldmatrix`."""
        comptime for n2 in range(Self.DTILES // 2):
            var rows = Array[BF16Ptr, Self.lanes](fill=values)
            for l in range(Self.lanes):
                var lane = self.lane(l)
                var key = self.warp_key() + 16 * j + lane // 8 % 2 * 8 + lane % 8
                rows[l] = values.unsafe_offset(swizzled[Self.BN](key, 2 * n2 + lane // 16))
            var b = ld_matrix[4, True, Self.lanes](rows)
            var b0 = Array[FragB, Self.lanes](fill=0)
            var b1 = Array[FragB, Self.lanes](fill=0)
            Self.split_operands(b, b0, b1)
            o.set(2 * n2, mma[Self.lanes, Self.PRODUCTS](a, b0, o.get(2 * n2)))
            o.set(2 * n2 + 1, mma[Self.lanes, Self.PRODUCTS](a, b1, o.get(2 * n2 + 1)))

    @staticmethod
    @always_inline
    def split_operands(
        b: Array[SIMD[DType.bfloat16, 8], Self.lanes],
        mut first: Array[FragB, Self.lanes],
        mut second: Array[FragB, Self.lanes],
    ):
        """The two B fragments of an `ldmatrix` of four matrices: its first
        and last two matrices, two n-tiles' (or k-halves') operands."""

        def halves(l: Int) {mut first, mut second, imm b}:
            first[l] = b[l].slice[4, offset=0]()
            second[l] = b[l].slice[4, offset=4]()

        each_lane[Self.lanes](halves)

    @staticmethod
    @always_inline
    def code_operand(codes: SIMD[DType.uint8, 4]) -> FragB:
        """A B fragment of four codes' float16 values (bits in bfloat16
        registers, `..warp.FragB`)."""
        return bitcast[DType.bfloat16, 4](
            codes_as_float16[Self.cache_dtype, 4](bitcast[Self.cache_dtype, 4](codes))
        )

    @staticmethod
    @always_inline
    def codes[width: Int](tile: BytePtr, key: Int, first: Int) -> SIMD[DType.uint8, width]:
        """Codes `first ..< first + width` (within one 16-byte chunk) of row
        `key` of a code tile `[BN, D]` (`mma_tiles.code_chunk`)."""
        var at = code_chunk[Self.D](key, first // 16) + first % 16
        return tile.unsafe_offset(at).unsafe_load[width=width, alignment=width](0)

    @always_inline
    def code_scores(self, queries: BF16Ptr, keys: BytePtr, mut s: Self.Scores):
        """Q Kᵀ of the warp's rows and keys, query fragments from
        `ldmatrix`, key fragments widened from the codes in registers: lane
        (g, t) reads bytes `t D/4 ..< (t + 1) D/4` of key g of each n-tile,
        four codes (a 32-bit word) per k-step, which `MmaTiles.query_dim`
        orders the queries' columns for."""
        comptime BYTES = Self.D // 4
        var rows = Array[SIMD[DType.uint8, BYTES], Self.NTILES * Self.lanes](fill=0)
        for l in range(Self.lanes):
            var first = self.lane(l) % 4 * BYTES
            comptime for n in range(Self.NTILES):
                var key = self.warp_key() + 8 * n + self.lane(l) // 4
                comptime if BYTES == 16:
                    rows[n * Self.lanes + l] = rebind[SIMD[DType.uint8, BYTES]](
                        Self.codes[16](keys, key, first)
                    )
                else:
                    rows[n * Self.lanes + l] = rebind[SIMD[DType.uint8, BYTES]](
                        Self.codes[16](keys, key, first).join(Self.codes[16](keys, key, first + 16))
                    )
        comptime for k in range(Self.KSTEPS):
            var a = self.query_fragment(queries, k)
            comptime for n in range(Self.NTILES):
                var b = Array[FragB, Self.lanes](fill=0)

                def widen(l: Int) {mut b, imm rows}:
                    b[l] = Self.code_operand(rows[n * Self.lanes + l].slice[4, offset=4 * k]())

                each_lane[Self.lanes](widen)
                s.set(n, mma[Self.lanes, Self.PRODUCTS](a, b, s.get(n)))

    @always_inline
    def code_values(
        self, a: Array[FragA, Self.lanes], values: BytePtr, j: Int, mut o: Self.Outputs
    ):
        """P V over keys 16 j .. of the warp's share, value fragments
        widened from the codes in registers: lane (g, t) reads bytes
        `g D/8 ..< (g + 1) D/8` of value rows 2t, 2t + 1, 2t + 8 and
        2t + 9, and output n-tile n takes byte n of each (the outputs'
        columns in `mma_outputs.output_dim`'s order)."""
        comptime BYTES = Self.D // 8
        var rows = Array[SIMD[DType.uint8, BYTES], 4 * Self.lanes](fill=0)
        for l in range(Self.lanes):
            var lane = self.lane(l)
            comptime for r in range(4):
                var key = self.warp_key() + 16 * j + 2 * (lane % 4) + r % 2 + r // 2 * 8
                rows[r * Self.lanes + l] = Self.codes[BYTES](values, key, lane // 4 * BYTES)
        # Two n-tiles at a time: a 32-bit word of two rows' bytes n and n + 1
        # is one byte permute, and converts to those n-tiles' float16 pairs.
        comptime for n in range(0, Self.DTILES, 2):
            var b0 = Array[FragB, Self.lanes](fill=0)
            var b1 = Array[FragB, Self.lanes](fill=0)

            def widen(l: Int) {mut b0, mut b1, imm rows}:
                var first = Self.code_operand(
                    SIMD[DType.uint8, 4](
                        rows[l][n],
                        rows[Self.lanes + l][n],
                        rows[l][n + 1],
                        rows[Self.lanes + l][n + 1],
                    )
                )
                var second = Self.code_operand(
                    SIMD[DType.uint8, 4](
                        rows[2 * Self.lanes + l][n],
                        rows[3 * Self.lanes + l][n],
                        rows[2 * Self.lanes + l][n + 1],
                        rows[3 * Self.lanes + l][n + 1],
                    )
                )
                b0[l] = first.slice[2, offset=0]().join(second.slice[2, offset=0]())
                b1[l] = first.slice[2, offset=2]().join(second.slice[2, offset=2]())

            each_lane[Self.lanes](widen)
            o.set(n, mma[Self.lanes, Self.PRODUCTS](a, b0, o.get(n)))
            o.set(n + 1, mma[Self.lanes, Self.PRODUCTS](a, b1, o.get(n + 1)))

    @always_inline
    def group_scores(
        self, queries: SharedMemory, keys: SharedMemory, warp: Int, mut s: Self.Scores
    ):
        """Starts the warpgroup's Q Kᵀ of a tile into `s` (zeros): one
        `wgmma` per 16 dims, its query rows those of `warp`'s warpgroup
        (this warp, as `MmaThread.uniform_warp` may give it); their results
        may be read after `warpgroup_wait`."""
        warpgroup_arrive()
        var group_row = warp // WARPGROUP_WARPS * WARPGROUP_ROWS
        comptime for k in range(Self.KSTEPS):
            wgmma_ss[Self.WARP_KEYS](
                k_slice(queries, Self.ROWS, k, group_row),
                k_slice(keys, Self.BN, k),
                s,
                self.warp() % WARPGROUP_WARPS,
            )

    @always_inline
    def group_values(self, p: Self.Weights, values: SharedMemory, mut o: Self.Outputs):
        """Starts the warpgroup's P V of a tile from its weights `p` into
        the outputs `o`, without waiting for it."""
        warpgroup_arrive()
        comptime for j in range(Self.WARP_KEYS // 16):
            wgmma_rs[Self.D](p.get(j), mn_slice[Self.BN](values, j), o)

"""Which keys a tensor-core warp's query rows see (`..mma`): causal, sliding
window, the block's context range, and none for a padding row.

Found once per block, as two 32-bit bounds per row of each lane's two rows
(`..warp`'s C layout: lane `(g, t)` holds rows `g` and `g + 8`) and two for
the whole block: a tile every row sees whole costs no masking instructions
at all (the eighth GPU run's profile found masking and its per-tile
divisions a fifth of the prefill's instructions), and a tile that needs
masking costs two compares per score, behind a branch the whole block
takes alike."""

from ...cache.traits import KVCacheT
from ..warp import Frags, fragment_row
from .config import NEG_INF
from .work import AttentionArgs, BlockWork


struct VisibleKeys[lanes: Int, ROW_HALVES: Int, NTILES: Int, STEP: Int](Copyable):
    """The visible keys of each lane's rows, over tiles spanning `STEP`
    positions whose scores are `NTILES` n-tiles a warp. `ROW_HALVES` 1 (a
    decode block's at most 8 rows): only each lane's first row is
    masked."""

    var rows: Frags[DType.int32, 2, 2, Self.lanes]
    """Each lane's two rows' first and last visible keys (positions; an
    empty range for a padding row)."""
    var block: SIMD[DType.int32, 2]
    """The keys every row of the block sees, first and last: a tile inside
    them needs no masking."""

    def __init__[
        cache_t: KVCacheT, q_dtype: DType, //
    ](
        out self,
        args: AttentionArgs[cache_t, q_dtype],
        work: BlockWork,
        first_row: Int,
        first_lane: Int,
    ):
        """The bounds of a warp whose first query row is `first_row`, for
        the program whose first lane is `first_lane`."""
        var rows = Frags[DType.int32, 2, 2, Self.lanes](0)
        var real_rows = work.rows(args.group)
        for l in range(Self.lanes):
            comptime for h in range(2):
                var r = fragment_row(first_row, first_lane + l, h)
                var keys = SIMD[DType.int32, 2](1, 0)
                if r < real_rows:
                    var position = work.position(r, args.group)
                    keys = SIMD[DType.int32, 2](
                        Int32(args.visible_start(position)), Int32(min(position, work.kv_end - 1))
                    )
                rows[h, l] = keys
        self.rows = rows^
        var last_position = work.position(max(real_rows, 1) - 1, args.group)
        self.block = SIMD[DType.int32, 2](
            Int32(args.visible_start(last_position)),
            Int32(min(work.first_position, work.kv_end - 1)),
        )

    @always_inline
    def whole(self, kv_start: Int) -> Bool:
        """Whether every query row of the block sees every key of the tile
        at `kv_start` (then nothing needs masking)."""
        var first = Int32(kv_start)
        return first >= self.block[0] and first + Int32(Self.STEP - 1) <= self.block[1]

    @always_inline
    def mask(
        self,
        first_key: Int,
        first_lane: Int,
        mut s: Frags[DType.float32, 4, Self.NTILES, Self.lanes],
    ):
        """-inf in place of the scores of keys a row does not see, for a
        warp whose first key lies at position `first_key`. Lane l's value e
        of score n-tile n is key `8 n + e` from the lane's first column."""
        for l in range(Self.lanes):
            # Unsigned: a signed remainder takes sign corrections, and
            # their 64-bit lane spilled the TMA-fed prefill at head_dim 128.
            var column = Int32(first_key) + Int32(UInt32(first_lane + l) % 4) * 2
            comptime for h in range(Self.ROW_HALVES):
                var first = self.rows[h, l][0] - column
                var last = self.rows[h, l][1] - column
                comptime for n in range(Self.NTILES):
                    var c = s[n, l]
                    comptime for e in range(2):
                        comptime local = Int32(n * 8 + e)
                        if local < first or local > last:
                            c[2 * h + e] = NEG_INF
                    s[n, l] = c

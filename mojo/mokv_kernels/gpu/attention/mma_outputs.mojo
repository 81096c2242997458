"""How a tensor-core block's warps write their rows once its last tile is
done (`..mma`): each warp its own rows (prefill, and decode with one KV
head a warp), or in decode, whose four warps each scored their own keys of
every tile for the same rows (a split-K of the tile across warps), each
warp's state saved to shared memory and the four combined, each rescaled
from its max to the common one.

The outputs are the C fragments of P V (`..warp`'s layout: lane `(g, t)`
holds rows `g` and `g + 8`, dims `2 t` and `2 t + 1` of each 8-dim n-tile),
or with `in_registers` (`MmaTiles.IN_REGISTERS`) the same values over dims
in `output_dim`'s order, which they are put back in as they are written."""

from std.math import exp2

from ...cache.traits import KVCacheT
from ...pointers import F32Ptr
from ..warp import MMA_ROWS, Frags, fragment_row
from .config import BLOCK_THREADS, NEG_INF, WARPS
from .mma_softmax import RowSoftmax
from .work import AttentionArgs, BlockWork, write_row_part


def output_dim[D: Int](column: Int) -> Int:
    """`in_registers`: the dim of the values (and outputs) in column
    `column` of a value product: lane g reads bytes `g * D / 8 ..` of each
    value row (`..mma_products.WarpProducts.code_values`), one per n-tile."""
    return column % 8 * (D // 8) + column // 8


struct MmaOutputs[D: Int, lanes: Int, ROW_HALVES: Int, in_registers: Bool]:
    """A warp's outputs `[16, D]` written as rows, or saved and combined as
    decode states. `ROW_HALVES` 1: only each lane's first row is real (a
    decode block's at most 8 rows)."""

    comptime DTILES = Self.D // 8
    """Output n-tiles (8 dims each)."""
    comptime STATE_FLOATS = MMA_ROWS * Self.D + 2 * MMA_ROWS
    """A decode warp's state: outputs `[16, D]`, then each row's max and sum."""
    comptime Accumulators = Frags[DType.float32, 4, Self.DTILES, Self.lanes]

    @staticmethod
    @always_inline
    def write_rows[
        cache_t: KVCacheT, NTILES: Int, scales_per_key: Bool, products: DType, //
    ](
        args: AttentionArgs[cache_t, DType.bfloat16],
        work: BlockWork,
        first_row: Int,
        first_lane: Int,
        o: Self.Accumulators,
        softmax: RowSoftmax[
            Self.lanes, NTILES, Self.DTILES, Self.ROW_HALVES, scales_per_key, products
        ],
    ):
        """The warp's normalised outputs, or this split's state for the
        merge, for a warp whose first row is `first_row`: each lane writes
        two dims of each of its rows per n-tile (`in_registers`: its values
        of every n-tile, which `output_dim` puts in two runs of contiguous
        dims)."""
        var rows = work.rows(args.group)
        comptime for h in range(Self.ROW_HALVES):
            var sums = softmax.row_sums(h)
            for l in range(Self.lanes):
                var lane = first_lane + l
                var r = fragment_row(first_row, lane, h)
                if r < rows:
                    comptime if Self.in_registers:
                        # Value e of every n-tile: dims (2 t + e) D/8 + n
                        # (`output_dim`), DTILES contiguous dims.
                        comptime for e in range(2):
                            var dims = SIMD[DType.float32, Self.DTILES](0)
                            comptime for n in range(Self.DTILES):
                                dims[n] = o[n, l][2 * h + e]
                            write_row_part[Self.D, Self.DTILES](
                                args,
                                work,
                                r,
                                (2 * (lane % 4) + e) * Self.DTILES,
                                dims,
                                softmax.row_max[h, l][0],
                                sums[l],
                                lane % 4 == 0 and e == 0,
                            )
                    else:
                        comptime for n in range(Self.DTILES):
                            var acc = o[n, l]
                            write_row_part[Self.D, 2](
                                args,
                                work,
                                r,
                                n * 8 + 2 * (lane % 4),
                                SIMD[DType.float32, 2](acc[2 * h], acc[2 * h + 1]),
                                softmax.row_max[h, l][0],
                                sums[l],
                                n == 0 and lane % 4 == 0,
                            )

    @staticmethod
    @always_inline
    def state(states: F32Ptr, warp: Int) -> F32Ptr:
        """Decode: where warp `warp` leaves its state among the block's
        `states` (over its stages, free once its last tile is done)."""
        return states.unsafe_offset(warp * Self.STATE_FLOATS)

    @staticmethod
    @always_inline
    def save_state[
        NTILES: Int, scales_per_key: Bool, products: DType, //
    ](
        state: F32Ptr,
        first_lane: Int,
        o: Self.Accumulators,
        softmax: RowSoftmax[
            Self.lanes, NTILES, Self.DTILES, Self.ROW_HALVES, scales_per_key, products
        ],
    ):
        """Decode: the warp's outputs, maxima and sums into its `state`."""
        comptime for h in range(Self.ROW_HALVES):
            var sums = softmax.row_sums(h)
            for l in range(Self.lanes):
                var lane = first_lane + l
                var r = fragment_row(0, lane, h)
                comptime for n in range(Self.DTILES):
                    var acc = o[n, l]
                    var column = n * 8 + 2 * (lane % 4)
                    comptime if Self.in_registers:
                        comptime for e in range(2):
                            state[unsafe_offset=r * Self.D + output_dim[Self.D](column + e)] = acc[
                                2 * h + e
                            ]
                    else:
                        state.unsafe_store(
                            r * Self.D + column, SIMD[DType.float32, 2](acc[2 * h], acc[2 * h + 1])
                        )
                if lane % 4 == 0:
                    state[unsafe_offset=MMA_ROWS * Self.D + r] = softmax.row_max[h, l][0]
                    state[unsafe_offset=MMA_ROWS * Self.D + MMA_ROWS + r] = sums[l]

    @staticmethod
    @always_inline
    def combine[
        cache_t: KVCacheT, //
    ](args: AttentionArgs[cache_t, DType.bfloat16], work: BlockWork, states: F32Ptr, tid: Int):
        """Decode: every thread (of the program at thread `tid`) combines
        the warps' states of a few groups of 4 dims of a row, each warp's
        rescaled from its max to the common one, and writes them
        (normalised, or the split's state)."""
        comptime QUADS = Self.D // 4
        var rows = work.rows(args.group)
        for l in range(Self.lanes):
            for u in range(tid + l, MMA_ROWS * QUADS, BLOCK_THREADS):
                var r = u // QUADS
                var d = u % QUADS * 4
                if r >= rows:
                    continue
                var best = NEG_INF
                comptime for w in range(WARPS):
                    best = max(best, Self.state(states, w)[unsafe_offset=MMA_ROWS * Self.D + r])
                var acc = SIMD[DType.float32, 4](0)
                var total: Float32 = 0
                comptime for w in range(WARPS):
                    var state = Self.state(states, w)
                    var own = state[unsafe_offset=MMA_ROWS * Self.D + r]
                    if own != NEG_INF:
                        var weight = exp2(own - best)
                        acc += weight * state.unsafe_load[width=4](r * Self.D + d)
                        total += weight * state[unsafe_offset=MMA_ROWS * Self.D + MMA_ROWS + r]
                write_row_part[Self.D, 4](args, work, r, d, acc, best, total, d == 0)

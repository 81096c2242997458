"""The online softmax of a tensor-core warp's scores, in its registers
(`..mma`): the scores are the C fragments of m16n8k16 products (`..warp`'s
layout: lane `(g, t)` holds rows `g` and `g + 8`, keys `2 t` and `2 t + 1` of
each 8-key n-tile), so a row lives in a quad of four lanes, and each lane
keeps its two rows' running max and its own share of their running sums.

Per tile and row: the max of the row's logits (a tree in each lane, then
two shuffles across the quad), each score made its weight, the row's sum
moved on, and the row's outputs rescaled only when its max moves (most
tiles of a long context leave it alone). The weights, rounded to the
products' type, are the A operand of P V as they are: a pair of C fragments
is an A fragment, so P never leaves the registers."""

from std.math import exp2
from std.memory import bitcast

from ..warp import FragA, Frags, each_lane, shuffle_xor
from .config import NEG_INF


@always_inline
def quad_combine[
    is_max: Bool, lanes: Int
](var values: Array[Float32, lanes]) -> Array[Float32, lanes]:
    """`values` combined (max, or sum) over each quad of lanes that share a
    row."""
    comptime for i in range(2):
        var other = shuffle_xor[lanes](values, 1 << i)
        for l in range(lanes):
            comptime if is_max:
                values[l] = max(values[l], other[l])
            else:
                values[l] += other[l]
    return values^


struct RowSoftmax[
    lanes: Int,
    NTILES: Int,
    DTILES: Int,
    ROW_HALVES: Int,
    scales_per_key: Bool,
    products: DType,
](Copyable):
    """Each lane's two rows' running max and its share of their running
    sums, over score tiles of `NTILES` n-tiles and outputs of `DTILES`.
    `ROW_HALVES` 1 (a decode block's at most 8 rows): only each lane's
    first row is real; the second's weights are zeroed. `scales_per_key`:
    the scores come with each key's value log-scale, and the weights P V
    takes are the softmax's weights times the value scales (`..mma`'s
    `MmaThread`), while the sums add the softmax's weights alone."""

    comptime Scores = Frags[DType.float32, 4, Self.NTILES, Self.lanes]
    comptime Outputs = Frags[DType.float32, 4, Self.DTILES, Self.lanes]
    comptime Factors = Frags[DType.float32, 1, 2, Self.lanes]
    comptime Weights = Frags[DType.bfloat16, 8, Self.NTILES // 2, Self.lanes]
    """A tile's weights as P V's A operands, one per k-step (`all_weights`)."""

    var row_max: Frags[DType.float32, 1, 2, Self.lanes]
    var row_sum: Frags[DType.float32, 1, 2, Self.lanes]

    def __init__(out self):
        self.row_max = Frags[DType.float32, 1, 2, Self.lanes](NEG_INF)
        self.row_sum = Frags[DType.float32, 1, 2, Self.lanes](0)

    @always_inline
    def tile[
        deferred: Bool
    ](
        mut self,
        mut s: Self.Scores,
        log_scales: Frags[DType.float32, 2, Self.NTILES, Self.lanes],
        logit_scale: Float32,
        mut outputs: Self.Outputs,
    ) -> Self.Factors:
        """The online softmax of a tile over its scores `s` (-inf where
        masked; times `logit_scale` they are base-2 logits): each row's max
        and sum moved on, `s` made the weights. Each row's factor (1 where
        its max stayed) is returned; the `outputs` are rescaled by it here,
        or where `deferred` by the caller, once products still adding to
        them have landed."""
        var factors = Self.Factors(1)
        # A row's max times `logit_scale` (positive, `...bind.check_scale`)
        # is the max of its logits, and each exponent's multiply-add takes
        # it, no multiplication of its own. Maxima and sums are reduced as
        # trees (`reduce_max`, `reduce_add` of a lane's values at once): one
        # running max or sum made a chain of 16 dependent instructions per
        # row, each waiting on the last (the eighth run's profile: a third
        # of the cycles between a warp's instructions waited on such
        # dependencies).
        comptime for h in range(Self.ROW_HALVES):
            var best = Array[Float32, Self.lanes](fill=NEG_INF)
            for l in range(Self.lanes):
                var logits = SIMD[DType.float32, 2 * Self.NTILES](0)
                comptime for n in range(Self.NTILES):
                    comptime for e in range(2):
                        logits[2 * n + e] = s[n, l][2 * h + e]
                        comptime if Self.scales_per_key:
                            logits[2 * n + e] += log_scales[n, l][e]
                best[l] = logits.reduce_max() * logit_scale
            best = quad_combine[True](best^)
            for l in range(Self.lanes):
                var new_max = max(self.row_max[h, l][0], best[l])
                var base = new_max if new_max != NEG_INF else 0
                var alpha = exp2(self.row_max[h, l][0] - base)
                var weights = SIMD[DType.float32, 2 * Self.NTILES](0)
                comptime for n in range(Self.NTILES):
                    var c = s[n, l]
                    comptime for e in range(2):
                        var p = exp2(c[2 * h + e] * logit_scale - base)
                        weights[2 * n + e] = p
                        comptime if Self.scales_per_key:
                            # The weight P V takes: times the value scale.
                            p = exp2(c[2 * h + e] + log_scales[n, l][e] - base)
                        c[2 * h + e] = p
                    s[n, l] = c
                self.row_sum[h, l] = self.row_sum[h, l] * alpha + weights.reduce_add()
                factors[h, l] = alpha
                comptime if not deferred:
                    if new_max != self.row_max[h, l][0]:
                        # Most tiles of a long context leave the max as it
                        # was: then the outputs keep their scale and cost
                        # nothing.
                        Self.rescale(outputs, h, l, alpha)
                self.row_max[h, l] = new_max
        comptime if Self.ROW_HALVES == 1:
            # Padding rows weigh nothing (their outputs are never read).
            for l in range(Self.lanes):
                comptime for n in range(Self.NTILES):
                    var c = s[n, l]
                    c[2] = 0
                    c[3] = 0
                    s[n, l] = c
        return factors^

    @staticmethod
    @always_inline
    def rescale(mut outputs: Self.Outputs, h: Int, l: Int, alpha: Float32):
        """Lane `l`'s row `h` outputs times `alpha` (its softmax's factor)."""
        comptime for n in range(Self.DTILES):
            var acc = outputs[n, l]
            acc[2 * h] *= alpha
            acc[2 * h + 1] *= alpha
            outputs[n, l] = acc

    @always_inline
    def row_sums(self, h: Int) -> Array[Float32, Self.lanes]:
        """Each lane's row `h` running sum, over the quad."""
        var sums = Array[Float32, Self.lanes](fill=0)
        for l in range(Self.lanes):
            sums[l] = self.row_sum[h, l][0]
        return quad_combine[False](sums^)

    @staticmethod
    @always_inline
    def weights(s: Self.Scores, j: Int) -> Array[FragA, Self.lanes]:
        """The A fragment of P V over keys 16 j ..: score n-tiles 2 j and
        2 j + 1 rounded to the products' type (a C fragment pair is an A
        fragment)."""
        var a = Array[FragA, Self.lanes](fill=0)

        def rounded(l: Int) {mut a, imm s, var j}:
            a[l] = bitcast[DType.bfloat16, 8](
                s[2 * j, l].cast[Self.products]().join(s[2 * j + 1, l].cast[Self.products]())
            )

        each_lane[Self.lanes](rounded)
        return a^

    @staticmethod
    @always_inline
    def all_weights(s: Self.Scores) -> Self.Weights:
        """The A operands of a tile's P V, every k-step's (`weights`): what a
        warpgroup product takes."""
        var p = Self.Weights(0)
        comptime for j in range(Self.NTILES // 2):
            p.set(j, Self.weights(s, j))
        return p^

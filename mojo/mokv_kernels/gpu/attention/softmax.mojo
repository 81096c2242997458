"""Online softmax over a tile of scores in shared memory, shared by the GPU
attention kernels.

A block scores its query rows against `BN` keys into `p[rows][BN]` (base-2
logits, `-inf` where masked), then in three phases with a barrier between
them: `LPR` threads per row take partial maxima over the keys `u + LPR * i`;
the same threads turn scores into weights `exp2(score - new max)` and sum
them, and one of them sets the row's rescale factor `alpha` for what it
accumulated before; after the weighted values are added, `update` folds the
tile into the row's running max and sum."""

from std.math import exp2


from ...pointers import F32Ptr
from .config import NEG_INF


@fieldwise_init
struct TileSoftmax[BM: Int, BN: Int, LPR: Int](TrivialRegisterPassable):
    """The online softmax of `BM` query rows, in shared memory from `base`:
    scores `[BM, BN]`, per row its running max, running sum and rescale
    factor, then `LPR` partial maxima and sums per row. One pointer, and
    every region at a compile-time offset from it, so a kernel can make one
    whenever it needs it without holding registers for it."""

    comptime KPL = Self.BN // Self.LPR
    """Keys per thread in the partial phases."""
    comptime MAX = Self.BM * Self.BN
    comptime SUM = Self.MAX + Self.BM
    comptime ALPHA = Self.SUM + Self.BM
    comptime PART_MAX = Self.ALPHA + Self.BM
    comptime PART_SUM = Self.PART_MAX + Self.BM * Self.LPR
    comptime FLOATS = Self.PART_SUM + Self.BM * Self.LPR
    """Shared-memory words of all the regions."""

    var base: F32Ptr

    def score(self, r: Int, j: Int) -> F32Ptr:
        """Where row `r`'s score (then weight) of key `j` lives."""
        return self.base.unsafe_offset(r * Self.BN + j)

    def row_max(self, r: Int) -> Float32:
        return self.base[unsafe_offset=Self.MAX + r]

    def row_sum(self, r: Int) -> Float32:
        return self.base[unsafe_offset=Self.SUM + r]

    def alpha(self, r: Int) -> Float32:
        """Row `r`'s factor for what it accumulated before this tile."""
        return self.base[unsafe_offset=Self.ALPHA + r]

    def reset(self, r: Int):
        """Row `r` before its first tile."""
        self.base[unsafe_offset=Self.MAX + r] = NEG_INF
        self.base[unsafe_offset=Self.SUM + r] = 0

    def partial_max(self, r: Int, u: Int):
        var best = NEG_INF
        for i in range(Self.KPL):
            best = max(best, self.score(r, u + i * Self.LPR)[])
        self.base[unsafe_offset=Self.PART_MAX + r * Self.LPR + u] = best

    def new_max(self, r: Int) -> Float32:
        """Row `r`'s running max including this tile."""
        var best = self.row_max(r)
        for u in range(Self.LPR):
            best = max(best, self.base[unsafe_offset=Self.PART_MAX + r * Self.LPR + u])
        return best

    def exponentiate(self, r: Int, u: Int):
        """Scores become `exp2(score - new max)`, with their partial sum; the
        row's `u == 0` thread sets its rescale factor."""
        var new_max = self.new_max(r)
        var total: Float32 = 0
        for i in range(Self.KPL):
            var p = self.score(r, u + i * Self.LPR)
            var weight: Float32 = 0
            if new_max != NEG_INF:
                weight = exp2(p[] - new_max)
            p[] = weight
            total += weight
        self.base[unsafe_offset=Self.PART_SUM + r * Self.LPR + u] = total
        if u == 0:
            var old_max = self.row_max(r)
            self.base[unsafe_offset=Self.ALPHA + r] = 1 if new_max == NEG_INF else exp2(
                old_max - new_max
            )

    def update(self, r: Int):
        """Row `r`'s running sum and max with this tile folded in (after
        every thread has read `alpha`)."""
        var total = self.row_sum(r) * self.alpha(r)
        for u in range(Self.LPR):
            total += self.base[unsafe_offset=Self.PART_SUM + r * Self.LPR + u]
        var new_max = self.new_max(r)
        self.base[unsafe_offset=Self.SUM + r] = total
        self.base[unsafe_offset=Self.MAX + r] = new_max

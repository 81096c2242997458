"""Online softmax over a tile of scores in shared memory, shared by the GPU
attention kernels.

A block scores its query rows against `BN` keys into `p[rows][BN]` (base-2
logits, `-inf` where masked), then in three phases with a barrier between
them: `LPR` threads per row take partial maxima over the keys `u + LPR * i`;
the same threads turn scores into weights `exp2(score - new max)` and sum
them, and one of them sets the row's rescale factor `alpha` for what it
accumulated before; after the weighted values are added, `update` folds the
tile into the row's running max and sum."""

from .attention_work import NEG_INF
from .block import F32Ptr
from std.math import exp2


@fieldwise_init
struct TileSoftmax[BN: Int, LPR: Int](TrivialRegisterPassable):
    """Pointers into shared memory: scores `p [rows][BN]`, per row its
    running max, running sum and rescale factor, and `LPR` partial maxima
    and sums per row."""

    comptime KPL = Self.BN // Self.LPR
    """Keys per thread in the partial phases."""
    comptime FLOATS_PER_ROW = Self.BN + 3 + 2 * Self.LPR
    """Shared-memory words per query row, over all the regions."""

    var p: F32Ptr
    var running_max: F32Ptr
    var running_sum: F32Ptr
    var alpha: F32Ptr
    var part_max: F32Ptr
    var part_sum: F32Ptr

    @staticmethod
    def at(base: F32Ptr, rows: Int) -> Self:
        """The regions for `rows` query rows laid out from `base`, in the
        order of the fields: `rows * FLOATS_PER_ROW` words."""
        var p = base
        var running_max = p.unsafe_offset(rows * Self.BN)
        var running_sum = running_max.unsafe_offset(rows)
        var alpha = running_sum.unsafe_offset(rows)
        var part_max = alpha.unsafe_offset(rows)
        var part_sum = part_max.unsafe_offset(rows * Self.LPR)
        return Self(p, running_max, running_sum, alpha, part_max, part_sum)

    def reset(self, r: Int):
        """Row `r` before its first tile."""
        self.running_max[unsafe_offset=r] = NEG_INF
        self.running_sum[unsafe_offset=r] = 0

    def score(self, r: Int, j: Int) -> F32Ptr:
        """Where row `r`'s score (then weight) of key `j` lives."""
        return self.p.unsafe_offset(r * Self.BN + j)

    def partial_max(self, r: Int, u: Int):
        var best = NEG_INF
        for i in range(Self.KPL):
            best = max(best, self.score(r, u + i * Self.LPR)[])
        self.part_max[unsafe_offset=r * Self.LPR + u] = best

    def new_max(self, r: Int) -> Float32:
        """Row `r`'s running max including this tile."""
        var best = self.running_max[unsafe_offset=r]
        for u in range(Self.LPR):
            best = max(best, self.part_max[unsafe_offset=r * Self.LPR + u])
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
        self.part_sum[unsafe_offset=r * Self.LPR + u] = total
        if u == 0:
            var old_max = self.running_max[unsafe_offset=r]
            self.alpha[unsafe_offset=r] = 1 if new_max == NEG_INF else exp2(old_max - new_max)

    def update(self, r: Int):
        """Row `r`'s running sum and max with this tile folded in (after
        every thread has read `alpha`)."""
        var total = self.running_sum[unsafe_offset=r] * self.alpha[unsafe_offset=r]
        for u in range(Self.LPR):
            total += self.part_sum[unsafe_offset=r * Self.LPR + u]
        var new_max = self.new_max(r)
        self.running_sum[unsafe_offset=r] = total
        self.running_max[unsafe_offset=r] = new_max

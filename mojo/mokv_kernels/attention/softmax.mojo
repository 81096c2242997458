"""The online softmax of query rows over context tiles, and the merge of the
partial states of a context split over several work items.

The score matrix is never materialised: context tokens are visited in tiles of
`TILE`, and every query row keeps an online softmax (running max `m`, running
sum `l`, unnormalised output `acc`), all in float32 whatever the storage dtype.
Scores are kept in base 2: queries are pre-multiplied by `scale * log2(e)`.

Scores of a tile are stored token-major (`[TILE, rows]`), so the softmax
bookkeeping runs across query rows in full vectors.
"""

from std.math import exp2

from ..pointers import F32Ptr
from .config import NEG_INF, SKEW, TILE, Vec, W
from .queries import RaggedQueries
from .scratch import Arena


@fieldwise_init
struct SoftmaxState(TrivialRegisterPassable):
    """Online-softmax state of `rows` query rows (a multiple of `W`): the
    current tile's scores, token-major `[TILE, rows]` so that the softmax runs
    across rows in full vectors (and turns them into probabilities in place),
    the running max and sum per row, and the unnormalised output
    `[rows, head_dim]`. Score columns lie `rows + SKEW` floats apart."""

    var scores: F32Ptr
    var row_max: F32Ptr
    var row_sum: F32Ptr
    var alpha: F32Ptr
    var acc: F32Ptr
    var rows: Int
    var head_dim: Int

    @staticmethod
    def floats(rows: Int, head_dim: Int) -> Int:
        """Scratch floats that `take` carves out of an arena."""
        return (rows + SKEW) * TILE + rows * (3 + head_dim)

    @staticmethod
    def take(mut arena: Arena, rows: Int, head_dim: Int) -> Self:
        var scores = arena.take((rows + SKEW) * TILE)
        var row_max = arena.take(rows, NEG_INF)
        var row_sum = arena.take(rows)
        var alpha = arena.take(rows)
        return Self(scores, row_max, row_sum, alpha, arena.take(rows * head_dim), rows, head_dim)

    def column(self, j: Int) -> F32Ptr:
        """Scores (then probabilities) of tile token `j`, one per row."""
        return self.scores.unsafe_offset(j * (self.rows + SKEW))

    def acc_row(self, r: Int) -> F32Ptr:
        return self.acc.unsafe_offset(r * self.head_dim)

    def update(self, n: Int):
        """Folds the scores of tile tokens `0 ..< n` into the running state,
        leaving their probabilities (relative to the new max) in place, and
        rescales the outputs of rows whose max moved."""
        for r in range(0, self.rows, W):
            var tile_max = Vec(NEG_INF)
            for j in range(n):
                tile_max = max(tile_max, self.column(j).unsafe_load[width=W](r))
            var old_max = self.row_max.unsafe_load[width=W](r)
            var new_max = max(old_max, tile_max)
            # A row that has seen nothing yet keeps max -inf: subtract 0 so
            # its probabilities come out exp2(-inf) = 0 rather than NaN.
            var shift = new_max.eq(Vec(NEG_INF)).select(Vec(0), new_max)
            var total = Vec(0)
            for j in range(n):
                var p = exp2(self.column(j).unsafe_load[width=W](r) - shift)
                self.column(j).unsafe_store(r, p)
                total += p
            var alpha = exp2(old_max - shift)
            self.row_sum.unsafe_store(r, self.row_sum.unsafe_load[width=W](r) * alpha + total)
            self.row_max.unsafe_store(r, new_max)
            self.alpha.unsafe_store(r, alpha)
        for r in range(self.rows):
            var alpha = self.alpha[unsafe_offset=r]
            if alpha != 1:
                var acc = self.acc_row(r)
                for i in range(0, self.head_dim, W):
                    acc.unsafe_store(i, acc.unsafe_load[width=W](i) * alpha)


struct PartialState(TrivialRegisterPassable):
    """A split item's softmax state in the shared partials buffer, for `rows`
    output rows: `acc [rows, head_dim]`, then `row_max [rows]`, `row_sum [rows]`."""

    var base: F32Ptr
    var rows: Int
    var head_dim: Int

    def __init__(out self, base: F32Ptr, rows: Int, head_dim: Int):
        self.base = base
        self.rows = rows
        self.head_dim = head_dim

    @staticmethod
    def floats(rows: Int, head_dim: Int) -> Int:
        return rows * (head_dim + 2)

    def acc(self, r: Int) -> F32Ptr:
        return self.base.unsafe_offset(r * self.head_dim)

    def row_max(self) -> F32Ptr:
        return self.base.unsafe_offset(self.rows * self.head_dim)

    def row_sum(self) -> F32Ptr:
        return self.base.unsafe_offset(self.rows * (self.head_dim + 1))

    def save(self, r: Int, state: SoftmaxState, state_row: Int):
        """Copies row `state_row` of an item's softmax state to row `r`."""
        self.row_max()[unsafe_offset=r] = state.row_max[unsafe_offset=state_row]
        self.row_sum()[unsafe_offset=r] = state.row_sum[unsafe_offset=state_row]
        var dst = self.acc(r)
        var src = state.acc_row(state_row)
        for i in range(0, self.head_dim, W):
            dst.unsafe_store(i, src.unsafe_load[width=W](i))


@fieldwise_init
struct SplitGroup(TrivialRegisterPassable):
    """Output rows whose context was split over `count` items: query heads
    `first_head ..< first_head + num_heads` of new tokens `first_token ..<
    first_token + num_tokens` of batch row `row`, with the items' partial
    states one after another from offset `first_state` on."""

    var row: Int
    var first_token: Int
    var num_tokens: Int
    var first_head: Int
    var num_heads: Int
    var first_state: Int
    var count: Int

    def rows(self) -> Int:
        """Output rows, token-major: row `t * num_heads + g` is head
        `first_head + g` of token `first_token + t`."""
        return self.num_tokens * self.num_heads

    def state(self, partials: F32Ptr, split: Int, head_dim: Int) -> PartialState:
        """The partial state of split `split < count`."""
        var floats = PartialState.floats(self.rows(), head_dim)
        return PartialState(
            partials.unsafe_offset(self.first_state + split * floats), self.rows(), head_dim
        )


def _merge_splits[dtype: DType](queries: RaggedQueries[dtype], group: SplitGroup, partials: F32Ptr):
    """Combines the partial softmax states of a split group and writes its
    outputs: each split's sum and output are rescaled to the global max. A
    split that saw none of a row's positions holds max -inf and weighs 0."""
    var d = queries.head_dim
    var arena = Arena(d)
    var acc = arena.take(d)
    for r in range(group.rows()):
        var global_max = NEG_INF
        for s in range(group.count):
            global_max = max(global_max, group.state(partials, s, d).row_max()[unsafe_offset=r])
        var total: Float32 = 0
        for i in range(0, d, W):
            acc.unsafe_store(i, Vec(0))
        for s in range(group.count):
            var state = group.state(partials, s, d)
            var weight = exp2(state.row_max()[unsafe_offset=r] - global_max)
            total += state.row_sum()[unsafe_offset=r] * weight
            var src = state.acc(r)
            for i in range(0, d, W):
                acc.unsafe_store(
                    i, acc.unsafe_load[width=W](i) + src.unsafe_load[width=W](i) * weight
                )
        var token = queries.token(group.row, group.first_token + r // group.num_heads)
        queries.store_row(token, group.first_head + r % group.num_heads, acc, 1 / total)
    _ = arena^

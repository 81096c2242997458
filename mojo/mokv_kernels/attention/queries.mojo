"""The queries of a ragged batch, where their outputs go, and the attention
parameters (GQA group, scale, sliding window)."""

from ..pointers import CachePtr, F32Ptr, U32Ptr
from .config import W


@fieldwise_init
struct RaggedQueries[dtype: DType](TrivialRegisterPassable):
    """The step's queries `[tokens, n_q_heads, head_dim]`, where their outputs
    go, and the attention parameters."""

    var q: CachePtr[Self.dtype]
    var out: CachePtr[Self.dtype]
    var row_offsets: U32Ptr
    var n_q_heads: Int
    var group: Int
    var head_dim: Int
    var scale_log2: Float32
    var window: Int

    def token(self, row: Int, index: Int) -> Int:
        """Index into `q`/`out` of new token `index` of batch row `row`."""
        return Int(self.row_offsets[unsafe_offset=row]) + index

    def visible_start(self, position: Int) -> Int:
        """First position that the token at `position` attends to."""
        if self.window > 0:
            return max(0, position + 1 - self.window)
        return 0

    def load_rows(self, dest: F32Ptr, token: Int, first_head: Int, count: Int):
        """Copies `count` query heads from `first_head` on of `token` to
        `dest` as float32, scaled into base-2 score units."""
        var src = self.q.unsafe_offset((token * self.n_q_heads + first_head) * self.head_dim)
        for i in range(0, count * self.head_dim, W):
            dest.unsafe_store(
                i, src.unsafe_load[width=W](i).cast[DType.float32]() * self.scale_log2
            )

    def store_row(self, token: Int, head: Int, acc: F32Ptr, inv_sum: Float32):
        """Writes `acc * inv_sum` as the output of query head `head`."""
        var dst = self.out.unsafe_offset((token * self.n_q_heads + head) * self.head_dim)
        for i in range(0, self.head_dim, W):
            dst.unsafe_store(i, (acc.unsafe_load[width=W](i) * inv_sum).cast[Self.dtype]())

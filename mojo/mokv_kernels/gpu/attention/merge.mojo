"""The split-K merge: when the context of a row was split over several
blocks, each wrote its unnormalised state (output, max, sum); one block per
(token, query head) combines them into the normalised output."""

from std.sys import bit_width_of
from std.math import exp2

from ...pointers import CachePtr, F32Ptr
from ..block import BlockExecutor, BlockId, KernelT, ThreadProgram
from .config import MAX_SPLITS, NEG_INF
from .work import split_state_offset

# Phases of a merge block (`MergeThread.step`).
comptime MERGE_READ = 0
comptime MERGE_WEIGH = 1
comptime MERGE_COMBINE = 2


struct MergeThread[dtype: DType, D: Int](ThreadProgram):
    """Combines the split states of one (token, query head), each rescaled
    from its own max to the common one. Thread s first reads split s's max
    and sum and turns them into the split's weight, in shared memory
    (`[MAX_SPLITS]` maxima, sums, weights); then every thread sums its
    output dims over the splits with those weights, so each split's
    `exp2` is computed once, not once per dim, and no thread walks the
    splits' maxima through global memory."""

    comptime THREADS = 128
    comptime MAXIMA = 0
    comptime SUMS = MAX_SPLITS
    comptime WEIGHTS = 2 * MAX_SPLITS
    comptime FLOATS = 3 * MAX_SPLITS
    comptime UNROLL = 4
    """Splits whose values one thread loads before adding them: independent
    loads in flight instead of one at a time."""

    var args: MergeArgs[Self.dtype]
    var token: Int
    var head: Int
    var tid: Int
    var shared: F32Ptr

    def __init__(
        out self, args: MergeArgs[Self.dtype], token: Int, head: Int, tid: Int, shared: F32Ptr
    ):
        comptime assert MAX_SPLITS <= Self.THREADS, "one thread per split"
        self.args = args
        self.token = token
        self.head = head
        self.tid = tid
        self.shared = shared

    def state(self, split: Int) -> F32Ptr:
        return self.args.partials.unsafe_offset(
            split_state_offset(
                split, self.token, self.head, self.args.total_tokens, self.args.n_q_heads, Self.D
            )
        )

    @always_inline
    def step(mut self, phase: Int, arg: Int):
        if phase == MERGE_READ:
            self.read_split()
        elif phase == MERGE_WEIGH:
            self.weigh_split()
        else:
            self.combine()

    @always_inline
    def read_split(self):
        """Thread s < splits: split s's max and sum into shared memory."""
        if self.tid < self.args.splits:
            var state = self.state(self.tid)
            self.shared[unsafe_offset=Self.MAXIMA + self.tid] = state[unsafe_offset=Self.D]
            self.shared[unsafe_offset=Self.SUMS + self.tid] = state[unsafe_offset=Self.D + 1]

    @always_inline
    def weigh_split(self):
        """Thread s < splits: split s's weight `exp2(max_s - max)`, 0 for a
        split that saw no visible key."""
        if self.tid < self.args.splits:
            var best = NEG_INF
            for s in range(self.args.splits):
                best = max(best, self.shared[unsafe_offset=Self.MAXIMA + s])
            var own = self.shared[unsafe_offset=Self.MAXIMA + self.tid]
            var weight: Float32 = 0
            if own != NEG_INF:
                weight = exp2(own - best)
            self.shared[unsafe_offset=Self.WEIGHTS + self.tid] = weight

    @always_inline
    def combine(self):
        """Every thread: the weighted sum of its dims over the splits, over
        the weighted sum of the splits' sums. A split of weight 0 adds
        nothing, whatever its values hold (they may never have been
        written)."""
        var splits = self.args.splits
        var total: Float32 = 0
        for s in range(splits):
            var weight = self.shared[unsafe_offset=Self.WEIGHTS + s]
            if weight != 0:
                total += weight * self.shared[unsafe_offset=Self.SUMS + s]
        var inv: Float32 = 1 / total if total > 0 else 0
        var out = self.args.out.unsafe_offset(
            (self.token * self.args.n_q_heads + self.head) * Self.D
        )
        for d in range(self.tid, Self.D, Self.THREADS):
            var value: Float32 = 0
            var s = 0
            while s < splits:
                # Every load of the step first (index clamped, weight 0 past the end),
                # then the products: loads in flight together.
                var weights = SIMD[DType.float32, Self.UNROLL](0)
                var values = SIMD[DType.float32, Self.UNROLL](0)
                comptime for u in range(Self.UNROLL):
                    var split = min(s + u, splits - 1)
                    if s + u < splits:
                        weights[u] = self.shared[unsafe_offset=Self.WEIGHTS + split]
                    values[u] = self.state(split)[unsafe_offset=d]
                var used = weights.ne(SIMD[DType.float32, Self.UNROLL](0))
                value += used.select(
                    weights * values, SIMD[DType.float32, Self.UNROLL](0)
                ).reduce_add()
                s += Self.UNROLL
            out[unsafe_offset=d] = (value * inv).cast[Self.dtype]()


@fieldwise_init
struct MergeArgs[dtype: DType](TrivialRegisterPassable):
    var partials: F32Ptr
    var out: CachePtr[Self.dtype]
    var total_tokens: Int
    var n_q_heads: Int
    var splits: Int


@fieldwise_init
struct MergeKernel[dtype: DType, D: Int](KernelT):
    """Grid (tokens, query heads): one block per output row of a split batch."""

    comptime Program = MergeThread[Self.dtype, Self.D]
    comptime THREADS = MergeThread[Self.dtype, Self.D].THREADS
    comptime MIN_BLOCKS = 1
    comptime NAME = "merge"
    comptime HEAD_DIM = Self.D
    comptime ELEMENT_BITS = bit_width_of[Self.dtype]()
    comptime SHARED_BYTES = Self.Program.FLOATS * 4

    var args: MergeArgs[Self.dtype]

    def grid(self) -> BlockId:
        return BlockId(self.args.total_tokens, self.args.n_q_heads, 1)

    @always_inline
    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        return Self.Program(self.args, block.x, block.y, tid, shared)

    @always_inline
    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        threads.each(MERGE_READ, 0)
        threads.sync()
        threads.each(MERGE_WEIGH, 0)
        threads.sync()
        threads.each(MERGE_COMBINE, 0)

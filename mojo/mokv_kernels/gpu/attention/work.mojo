"""What every GPU attention block shares: its arguments, its share of the
batch (query rows and context range), and how it writes its rows out.

Every attention kernel (`decode`, `prefill`) runs one thread block per
(query tile, KV head, batch row, split); this module says which rows and
which context positions such a block owns, and writes a row's finished
values: normalised outputs, or, when the context is split, the split's
unnormalised state (output, running max, running sum) that the merge kernel
combines."""

from std.math import ceildiv

from ...cache.traits import KVCacheT
from ...pointers import CachePtr, F32Ptr, U32Ptr
from ..block import BlockId
from ..rows import cached_row
from ..tensor_map import PageMaps
from .config import BLOCK_THREADS


@fieldwise_init
struct AttentionArgs[cache_t: KVCacheT, q_dtype: DType](TrivialRegisterPassable):
    """What every attention block reads: the caches (values, or 8-bit codes
    with their scales), queries and outputs of `q_dtype`."""

    var k_cache: Self.cache_t
    var v_cache: Self.cache_t
    var q: CachePtr[Self.q_dtype]
    var out: CachePtr[Self.q_dtype]
    var row_offsets: U32Ptr
    var partials: F32Ptr
    """Split states `[splits, total_tokens, n_q_heads, head_dim + 2]`
    (output, then max and sum), when `splits > 1`."""
    var total_tokens: Int
    var n_q_heads: Int
    var group: Int
    var scale_log2: Float32
    var window: Int
    var tokens_per_tile: Int
    var query_tiles: Int
    """Query tiles of the grid: the most new tokens of a row over
    `tokens_per_tile`."""
    var splits: Int
    var granularity: Int
    """Elements per scale of a quantized cache (`head_dim // granules`)."""
    var page_maps: PageMaps
    """The cache's tensor maps where a kernel copies its tiles as boxes
    (`..tensor_map`; `MmaThread.boxes`), else none."""

    def visible_start(self, position: Int) -> Int:
        """First position the token at `position` attends to."""
        if self.window > 0:
            return max(0, position + 1 - self.window)
        return 0

    def sees(self, position: Int, key: Int) -> Bool:
        """Whether the token at `position` attends to the key at `key`:
        not after it, and inside the window when there is one."""
        return key <= position and key >= self.visible_start(position)

    def key_row(self, work: BlockWork, pos: Int) -> Int:
        """The address of the key row at `pos` (every KV head's), or 0 when
        it is past `work`'s context range or not in the cache: a block reads
        no other row (a bad table entry is skipped, never followed)."""
        if pos >= work.kv_end:
            return 0
        return cached_row(self.k_cache, work.row, pos)

    def state_offset(self, split: Int, token: Int, head: Int, head_dim: Int) -> Int:
        return split_state_offset(split, token, head, self.total_tokens, self.n_q_heads, head_dim)


@fieldwise_init
struct BlockWork(TrivialRegisterPassable):
    """One block's query rows and context range; the same in all its threads.
    Query rows are token-major: row `r` is token `r // group`, query head
    `kv_head * group + r % group`."""

    var row: Int
    var kv_head: Int
    var split: Int
    var first_token: Int
    """Index into q/out of the block's first new token."""
    var num_tokens: Int
    var first_position: Int
    """Position of that token in its sequence."""
    var kv_start: Int
    var kv_end: Int

    def empty(self) -> Bool:
        return self.num_tokens <= 0

    def rows(self, group: Int) -> Int:
        """Query rows of the block that exist: tokens times the group."""
        return self.num_tokens * group

    def token(self, r: Int, group: Int) -> Int:
        """Index into q/out of query row `r`'s token."""
        return self.first_token + r // group

    def position(self, r: Int, group: Int) -> Int:
        """Position of query row `r`'s token."""
        return self.first_position + r // group

    def head(self, r: Int, group: Int) -> Int:
        return self.kv_head * group + r % group


def attention_grid[
    cache_t: KVCacheT, q_dtype: DType, //
](args: AttentionArgs[cache_t, q_dtype]) -> BlockId:
    """The grid of every attention kernel: x = KV head, y = query tile *
    splits + split, z = batch row (`block_work`). Blocks start in the order
    of their index in it, x fastest, so the heads of one tile start
    together, reading the same token rows of each page one after another in
    memory; and with query tiles handed out last first, the longest tiles
    of every head start before any shorter one. Modelled on the 2k-token
    prefill (64 tiles of 8 heads, one block per multiprocessor of an H200),
    that grid ends in 73 tile-times where tiles first, head after head,
    took 87. `plan` keeps y within `MAX_GRID_YZ`."""
    return BlockId(
        args.k_cache.num_heads(),
        args.query_tiles * args.splits,
        args.k_cache.batch_size(),
    )


def block_work[
    cache_t: KVCacheT, q_dtype: DType, //
](args: AttentionArgs[cache_t, q_dtype], block: BlockId, tile_tokens: Int) -> BlockWork:
    """Block (x = KV head, y = query tile * splits + split, z = batch row;
    `attention_grid`)'s rows and its split's share of their context,
    aligned to `tile_tokens`. Query tiles are handed out last first: a later
    tile sees more keys (its causal prefix is longer), so the longest
    blocks start first and the shortest fill the grid's tail."""
    var row = block.z
    var tile = args.query_tiles - 1 - block.y // args.splits
    var split = block.y % args.splits
    var start = Int(args.row_offsets[unsafe_offset=row])
    var end = Int(args.row_offsets[unsafe_offset=row + 1])
    var first = tile * args.tokens_per_tile
    var count = min(args.tokens_per_tile, end - start - first)
    if end > args.total_tokens or count <= 0:
        return BlockWork(row, block.x, split, 0, 0, 0, 0, 0)
    var first_position = args.k_cache.cache_length(row) + first
    var lo = args.visible_start(first_position)
    var hi = first_position + count
    var chunk = ceildiv(ceildiv(hi - lo, args.splits), tile_tokens) * tile_tokens
    var kv_start = min(hi, lo + split * chunk)
    return BlockWork(
        row,
        block.x,
        split,
        start + first,
        count,
        first_position,
        kv_start,
        min(hi, kv_start + chunk),
    )


def split_state_offset(
    split: Int, token: Int, head: Int, total_tokens: Int, n_q_heads: Int, head_dim: Int
) -> Int:
    """Where split `split`'s state of (token, query head) starts in the
    partials `[splits, total_tokens, n_q_heads, head_dim + 2]`."""
    return ((split * total_tokens + token) * n_q_heads + head) * (head_dim + 2)


def row_offset[
    cache_t: KVCacheT, q_dtype: DType, //, D: Int
](args: AttentionArgs[cache_t, q_dtype], work: BlockWork, r: Int) -> Int:
    """Where query row `r`'s `D` values start in q, and in out."""
    return (work.token(r, args.group) * args.n_q_heads + work.head(r, args.group)) * D


def stage_queries[
    cache_t: KVCacheT, q_dtype: DType, //, D: Int, BM: Int
](args: AttentionArgs[cache_t, q_dtype], work: BlockWork, tid: Int, dest: F32Ptr, stride: Int):
    """The block's `BM` query rows into `dest` (rows `stride` floats apart) as
    float32, scaled by `scale * log2(e)`; rows past the block's are zeros.
    Every thread of the block takes its share of the elements."""
    var rows = work.rows(args.group)
    for e in range(tid, BM * D, BLOCK_THREADS):
        var r = e // D
        var d = e % D
        var value: Float32 = 0
        if r < rows:
            value = (
                args.q[unsafe_offset=row_offset[D](args, work, r) + d].cast[DType.float32]()
                * args.scale_log2
            )
        dest[unsafe_offset=r * stride + d] = value


def write_row_part[
    cache_t: KVCacheT, q_dtype: DType, //, D: Int, W: Int
](
    args: AttentionArgs[cache_t, q_dtype],
    work: BlockWork,
    r: Int,
    d: Int,
    acc: SIMD[DType.float32, W],
    row_max: Float32,
    row_sum: Float32,
    writes_stats: Bool,
):
    """Writes dims `d ..< d + W` of query row `r`: its output divided by the
    row's sum, or with a split context the split's unnormalised output (and,
    from the one thread whose `writes_stats`, the row's max and sum)."""
    if args.splits == 1:
        var inv: Float32 = 1 / row_sum if row_sum > 0 else 0
        var out = args.out.unsafe_offset(row_offset[D](args, work, r) + d)
        comptime for i in range(W):
            out[unsafe_offset=i] = (acc[i] * inv).cast[q_dtype]()
    else:
        var state = args.partials.unsafe_offset(
            args.state_offset(work.split, work.token(r, args.group), work.head(r, args.group), D)
        )
        comptime for i in range(W):
            state[unsafe_offset=d + i] = acc[i]
        if writes_stats:
            state[unsafe_offset=D] = row_max
            state[unsafe_offset=D + 1] = row_sum

"""How a batch is cut into GPU attention blocks, on the host: the grid
comes from the batch summary's bounds, never from device memory."""

from std.math import ceildiv

from ...cache.batch_summary import BatchSummary
from ..block import MAX_GRID_YZ
from .config import DECODE_ROWS, MAX_SPLITS, MIN_SPLIT_TOKENS

comptime BLOCK_OVERHEAD_TILES = 2
"""A block's fixed cost, in tiles: loading its queries, writing its rows or
its split's state, and the merge's share of that state. Fit to the eighth
GPU run's split table (H200, 2026-11-28): without it the planner cut batch
128 at 1k into 4 splits, 10% slower than none, and 512 new tokens over 8.7k
into 34 splits of 4 tiles (8704 blocks), 1.0 ms where the seventh run's 2
splits took 0.52 ms; with it both stay whole, and batch 32 at 4k (3 splits)
and batch 1 at 32k (47) keep the counts that measured fastest."""


@fieldwise_init
struct BatchBounds(TrivialRegisterPassable):
    """Host-side upper bounds of a batch, which size the grid."""

    var max_new_tokens: Int
    var max_context: Int

    @staticmethod
    def of(summary: BatchSummary, total_tokens: Int, max_tokens: Int) -> Self:
        """The bounds that the batch summary states, capped by what the
        batch can hold: no row has more new tokens than the batch, nor a
        longer context than its lookup-table row addresses (or than its new
        tokens, when every cache is empty)."""
        var new_tokens = min(summary.max_new_tokens, total_tokens)
        var context = min(summary.max_context, max_tokens)
        if summary.max_cache_length == 0:
            context = min(context, new_tokens)
        return Self(new_tokens, max(context, new_tokens))


@fieldwise_init
struct AttentionPlan(TrivialRegisterPassable):
    """How a batch is cut into blocks."""

    var decode: Bool
    """Decode tile shape (`DECODE_ROWS` query rows) or prefill's."""
    var tokens_per_tile: Int
    var query_tiles: Int
    """Tiles per batch row: enough for the row with the most new tokens."""
    var splits: Int


struct KernelFit(TrivialRegisterPassable):
    """What the planner needs of a kernel, as the kernel states it (its
    `FIT`): how many of its blocks one multiprocessor holds at once, how
    many context positions a block reads per tile (a split is whole tiles,
    `work.block_work`), how many KV heads a block takes, and how many query
    rows of one KV head a tile holds (`DECODE_ROWS` in decode)."""

    var blocks_per_multiprocessor: Int
    var tile_keys: Int
    var heads_per_block: Int
    var query_rows: Int

    def __init__(
        out self,
        blocks_per_multiprocessor: Int,
        tile_keys: Int,
        heads_per_block: Int = 1,
        query_rows: Int = DECODE_ROWS,
    ):
        self.blocks_per_multiprocessor = blocks_per_multiprocessor
        self.tile_keys = tile_keys
        self.heads_per_block = heads_per_block
        self.query_rows = query_rows


def plan_attention(
    batch: Int,
    n_kv_heads: Int,
    group: Int,
    bounds: BatchBounds,
    multiprocessors: Int,
    decode_kernel: KernelFit,
    prefill_kernel: KernelFit,
    fixed_splits: Int = 0,
) -> AttentionPlan:
    """Picks the tile shape (decode, or the prefill kernel's tiles of its
    `query_rows`), then how many splits each context is cut into: the count
    that finishes soonest (`soonest_splits`) on `multiprocessors` times the
    blocks per multiprocessor of the kernel that runs, or `fixed_splits`
    when positive (tuning, `op`). No split shorter than `MIN_SPLIT_TOKENS`,
    nor more than `MAX_SPLITS`, nor more than a grid's y holds: it counts
    query tiles times splits (`work.attention_grid`)."""
    var max_new = max(bounds.max_new_tokens, 1)
    var decode = max_new * group <= decode_kernel.query_rows
    var kernel = decode_kernel if decode else prefill_kernel
    var tokens_per_tile = kernel.query_rows // group
    var query_tiles = ceildiv(max_new, tokens_per_tile)
    var most = min(
        max(1, bounds.max_context // MIN_SPLIT_TOKENS),
        MAX_SPLITS,
        max(1, MAX_GRID_YZ // query_tiles),
    )
    var splits: Int
    if fixed_splits > 0:
        splits = min(fixed_splits, most)
    else:
        splits = soonest_splits(
            query_tiles * ceildiv(n_kv_heads, kernel.heads_per_block) * batch,
            kernel.blocks_per_multiprocessor * multiprocessors,
            ceildiv(max(bounds.max_context, 1), kernel.tile_keys),
            most,
        )
    return AttentionPlan(decode, tokens_per_tile, query_tiles, splits)


def soonest_splits(blocks: Int, resident: Int, tiles: Int, most: Int) -> Int:
    """How many splits (1 to `most`) of a context of `tiles` tiles, for
    each of `blocks` blocks, finish soonest when `resident` blocks run at
    once and a block's time is its tiles plus `BLOCK_OVERHEAD_TILES`:
    `ceil(blocks * s / resident)` waves of `ceil(tiles / s) + overhead`.
    Decode blocks wait on memory one tile at a time, so a block's time is
    its tiles whether few or many run: a last wave of a few blocks costs a
    whole block's time, which one more split (or one fewer) can avoid, and
    a split whose blocks are only a few tiles long costs more in overhead
    than it saves. The fewest splits among equals."""
    var best = 1
    var best_time = ceildiv(blocks, resident) * (tiles + BLOCK_OVERHEAD_TILES)
    for s in range(2, most + 1):
        var time = ceildiv(blocks * s, resident) * (ceildiv(tiles, s) + BLOCK_OVERHEAD_TILES)
        if time < best_time:
            best = s
            best_time = time
    return best

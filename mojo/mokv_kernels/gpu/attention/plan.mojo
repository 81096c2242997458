"""How a batch is cut into GPU attention blocks, on the host: the grid
comes from the batch summary's bounds, never from device memory."""

from std.math import ceildiv

from ...cache.batch_summary import BatchSummary
from .config import DECODE_ROWS, MAX_SPLITS, MIN_SPLIT_TOKENS


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


def plan_attention(
    batch: Int,
    n_kv_heads: Int,
    group: Int,
    prefill_rows: Int,
    bounds: BatchBounds,
    multiprocessors: Int,
    decode_blocks: Int,
    prefill_blocks: Int,
    fixed_splits: Int = 0,
) -> AttentionPlan:
    """Picks the tile shape (decode, or prefill tiles of `prefill_rows`
    query rows), then splits the context until the grid fills the device:
    as many blocks as are resident at once, `multiprocessors` times the
    blocks per multiprocessor of the kernel that runs (`decode_blocks` or
    `prefill_blocks`), so that a long context is one wave of longer splits
    rather than several of shorter ones; or into `fixed_splits` when it is
    positive (tuning, `op`). No split shorter than `MIN_SPLIT_TOKENS`, nor
    more than `MAX_SPLITS`."""
    var max_new = max(bounds.max_new_tokens, 1)
    var decode = max_new * group <= DECODE_ROWS
    var tokens_per_tile = (DECODE_ROWS if decode else prefill_rows) // group
    var query_tiles = ceildiv(max_new, tokens_per_tile)
    var blocks = query_tiles * n_kv_heads * batch
    var wanted = (decode_blocks if decode else prefill_blocks) * multiprocessors
    var splits = 1
    var by_context = max(1, bounds.max_context // MIN_SPLIT_TOKENS)
    if fixed_splits > 0:
        splits = min(fixed_splits, by_context, MAX_SPLITS)
    elif blocks < wanted:
        splits = max(1, min(ceildiv(wanted, blocks), by_context, MAX_SPLITS))
    return AttentionPlan(decode, tokens_per_tile, query_tiles, splits)

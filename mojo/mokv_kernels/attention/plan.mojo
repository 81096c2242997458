"""Cutting a batch into work items.

An item of either kind (decode or prefill) that holds more than its share of
the batch's work is split over its context (split-K); the partial softmax
states are merged afterwards, so a few long decode rows, or a short chunk on a
long prefix, still keep every core busy.
"""

from std.math import ceildiv

from ..cache.batch_summary import BatchSummary
from ..cache.traits import KVCacheT
from .config import MIN_SPLIT, PREFILL_ROWS, SPLITS_PER_WORKER
from .queries import RaggedQueries
from .softmax import PartialState, SplitGroup


@fieldwise_init
struct WorkItem(TrivialRegisterPassable):
    """New tokens `first_token ..< first_token + num_tokens` of batch row `row`
    against context positions `ctx_start ..< ctx_end`.

    `kv_head` is -1 for a decode item (every head); `split` is -1 when the item
    covers the whole context and writes the output, else the offset of its
    `PartialState` in the partials buffer, merged by `_merge_splits`."""

    var row: Int
    var first_token: Int
    var num_tokens: Int
    var kv_head: Int
    var ctx_start: Int
    var ctx_end: Int
    var split: Int


def _output_heads(item: WorkItem, n_q_heads: Int, group: Int) -> Tuple[Int, Int]:
    """First query head and number of heads that `item` computes per token."""
    if item.kv_head < 0:
        return (0, n_q_heads)
    return (item.kv_head * group, group)


def _scores[q_dtype: DType, //](item: WorkItem, queries: RaggedQueries[q_dtype]) -> Int:
    """Query rows x context positions of `item`: its share of the batch's work."""
    var heads = _output_heads(item, queries.n_q_heads, queries.group)[1]
    return item.num_tokens * heads * (item.ctx_end - item.ctx_start)


def _plan[
    q_dtype: DType, //, cache_t: KVCacheT
](
    cache: cache_t,
    queries: RaggedQueries[q_dtype],
    summary: BatchSummary,
    batch: Int,
    workers: Int,
    mut items: List[WorkItem],
    mut groups: List[SplitGroup],
) -> Int:
    """Cuts the batch into work items and returns the floats of partial state
    that the split ones need.

    Prefill rows are cut into blocks of new tokens per KV head (first: they
    are the largest), decode rows make one item each. An item holding more
    than an even share of the batch's work (query rows x context tokens, over
    `SPLITS_PER_WORKER` items per worker) is then split over its context
    (split-K) into pieces of at least `MIN_SPLIT` tokens, so a few long
    sequences, or a short chunk on a long prefix, still keep every core busy.

    The batch summary (checked against every row beforehand) spares the
    passes that cannot find work: a batch of at most one new token per row
    has no prefill rows to cut, and one whose longest context is at most
    `MIN_SPLIT` tokens has no item to split."""
    var whole = List[WorkItem]()
    if summary.max_new_tokens > 1:
        # Whole tokens per block without spilling into another register block of rows.
        var max_block_tokens = max(1, PREFILL_ROWS // queries.group)
        for b in range(batch):
            var new_tokens = queries.token(b + 1, 0) - queries.token(b, 0)
            if new_tokens > 1:
                var cache_length = cache.cache_length(b)
                # Blocks of even size: a short remainder block would leave a core idle.
                var block_tokens = ceildiv(new_tokens, ceildiv(new_tokens, max_block_tokens))
                for t0 in range(0, new_tokens, block_tokens):
                    var count = min(block_tokens, new_tokens - t0)
                    var start = queries.visible_start(cache_length + t0)
                    for h in range(cache.num_heads()):
                        whole.append(
                            WorkItem(b, t0, count, h, start, cache_length + t0 + count, -1)
                        )
    for b in range(batch):
        if queries.token(b + 1, 0) - queries.token(b, 0) == 1:
            var cache_length = cache.cache_length(b)
            whole.append(
                WorkItem(b, 0, 1, -1, queries.visible_start(cache_length), cache_length + 1, -1)
            )
    if summary.max_context <= MIN_SPLIT:
        items.extend(whole^)
        return 0

    var total_work = 0
    for item in whole:
        total_work += _scores(item, queries)
    var share = max(1, ceildiv(total_work, workers * SPLITS_PER_WORKER))
    var partial_floats = 0
    for item in whole:
        var heads = _output_heads(item, queries.n_q_heads, queries.group)
        var length = item.ctx_end - item.ctx_start
        var pieces = min(ceildiv(_scores(item, queries), share), ceildiv(length, MIN_SPLIT))
        if pieces <= 1:
            items.append(item)
            continue
        var chunk = ceildiv(length, pieces)
        var group = SplitGroup(
            item.row,
            item.first_token,
            item.num_tokens,
            heads[0],
            heads[1],
            partial_floats,
            ceildiv(length, chunk),
        )
        var state_floats = PartialState.floats(group.rows(), queries.head_dim)
        for s in range(group.count):
            var first = item.ctx_start + s * chunk
            items.append(
                WorkItem(
                    item.row,
                    item.first_token,
                    item.num_tokens,
                    item.kv_head,
                    first,
                    min(item.ctx_end, first + chunk),
                    partial_floats + s * state_floats,
                )
            )
        partial_floats += group.count * state_floats
        groups.append(group)
    return partial_floats

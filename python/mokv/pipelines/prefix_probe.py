"""How much of a new request each replica's device prefix cache holds, asked
without claiming it: what MAX's scheduler reads to place a request on the
replica whose prefix is warmest (`get_prefix_cache_hit_counts`).

mokv's manager has no such query in its documented API (placement is the
caller's business there), so this reads each replica's prefix index directly
and changes nothing: it hashes the request's full pages before its last token
as `alloc` does (chained from its cache salt's root) and counts the verified
run of cached device pages continuing them. Lower tiers are not probed: a
disk or remote lookup reads and verifies whole page records, a load's cost
per request considered, so routing sees device pages only, as with MAX's own
(non-Jenga) manager.
"""

from __future__ import annotations

from ..context import cache_context
from ..paged import PagedKVCacheManager
from ..paged.block_pool import NO_UID
from ..paged.hashing import salted_root


def device_prefix_pages(manager: PagedKVCacheManager, context: object) -> list[int]:
    """Per replica, the leading pages of `context` its device prefix cache
    would serve if the request were claimed there now (0 without prefix
    caching, and for a context that processed tokens already: only a new
    request takes hits)."""
    ctx = cache_context(context)
    out = []
    for replica in manager._replicas:
        ps = replica.page_size
        hashable = (ctx.current_length - 1) // ps
        parent_uid: int | None = NO_UID
        root_hash = None
        if ctx.cache_salt is not None:
            parent_uid = replica._salt_uids.get(ctx.cache_salt)  # None: nothing cached under this salt here
            root_hash = salted_root(ctx.cache_salt)
        if not replica.prefix_caching or hashable < 1 or ctx.processed_length or parent_uid is None:
            out.append(0)
            continue
        tokens = ctx.tokens[: hashable * ps]
        hashes = replica.hasher.hash_blocks(tokens, root_hash)
        out.append(len(replica.pool.index.match(hashes, parent_uid, tokens.reshape(hashable, ps))))
    return out

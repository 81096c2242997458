"""How much of a new request each replica's device prefix cache holds, asked
without claiming it: what MAX's scheduler reads to place a request on the
replica whose prefix is warmest (`get_prefix_cache_hit_counts`).

mokv's manager has no such query in its documented API (placement is the
caller's business there), so this reads each replica's prefix index with the
read-only lookup `reserve` plans with (`device_prefix_hits`), and changes
nothing. Lower tiers are not probed: a disk or remote lookup reads and
verifies whole page records, a load's cost per request considered, so
routing sees device pages only, as with MAX's own (non-Jenga) manager.
"""

from __future__ import annotations

from ..context import cache_context
from ..paged import PagedKVCacheManager
from ..paged.manager import device_prefix_hits


def device_prefix_pages(manager: PagedKVCacheManager, context: object) -> list[int]:
    """Per replica, the leading pages of `context` its device prefix cache
    would serve if the request were claimed there now
    (`mokv.paged.manager.device_prefix_hits`)."""
    ctx = cache_context(context)
    return [len(device_prefix_hits(replica, ctx)) for replica in manager._replicas]

"""What `PagedKVCacheManager.reserve` checks before its first claim: whether
claiming and allocating a replica's new requests in turn would succeed,
replayed on the replica's pool without changing it."""

from __future__ import annotations

from collections.abc import Sequence

from ..context import CacheContext
from .replica import Replica


def device_prefix_hits(replica: Replica, ctx: CacheContext) -> list[int]:
    """The cached device pages `alloc` would reuse for `ctx` as a new request
    on `replica` now, read without changing anything (empty without prefix caching)."""
    return replica.lookup.device_hits(ctx) if replica.prefix_caching else []


def reservation_shortfall(replica: Replica, contexts: Sequence[CacheContext]) -> str | None:
    """Replays `claim` + `alloc` of new requests' `contexts`, in order, on
    `replica` without changing it; returns why the first one that would not
    fit does not, or None when all fit.

    Each request takes the device prefix hits `Replica.alloc` would find,
    cut at the first cached page an earlier request of the replay took from
    the free queue (which evicts it), and fresh pages from the front of the
    free queue, past the pages taken before it. Lower tiers are not asked
    (their hits need fresh pages like misses); that a tier hit loaded for one
    request would be a device hit for a later one is not replayed, so a
    batch repeating a prefix only a lower tier holds may be refused where
    claim + alloc would just fit, never the reverse.
    """
    ps = replica.page_size
    pool = replica.pool
    queue = pool.free_order()
    taken: set[int] = set()  # pages off the free queue in the replay: unheld hits and pages handed out
    evicted: set[int] = set()
    front = 0  # every page of `queue` before it is in `taken`
    capacity = replica.total_num_pages * ps
    for ctx in contexts:
        if ctx.current_length > capacity:
            return (
                f"request {ctx.request_id!r} needs {ctx.current_length} tokens of KV but replica "
                f"{replica.index} holds only {capacity} ({replica.total_num_pages} pages of {ps} tokens)"
            )
        hits = device_prefix_hits(replica, ctx) if ctx.active_length > 1 else []
        cut = next((i for i, page in enumerate(hits) if page in evicted), len(hits))
        del hits[cut:]
        needed = -(-ctx.current_length // ps)
        new = max(0, needed - len(hits))
        unheld = [page for page in hits if not pool.ref_count[page] and page not in taken]
        free = len(queue) - len(taken) - len(unheld)
        if new > free:
            return (
                f"request {ctx.request_id!r} needs {new} new pages on replica {replica.index} "
                f"({len(hits)} of its {needed} are prefix hits) but only {free} are free"
            )
        taken.update(unheld)
        while new:
            page = queue[front]
            front += 1
            if page not in taken:
                taken.add(page)
                if pool.index.is_committed(page):
                    evicted.add(page)
                new -= 1
    return None

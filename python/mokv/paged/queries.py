"""The documented queries and metrics of `PagedKVCacheManager` (MAX's
documented API): page counts, occupancy, admission control and counters.

`PagedKVCacheManager` inherits them. They read the replicas it routes to
(`batch_resolution.BatchResolver`) and change nothing but the counters
(`reset_metrics`), so they live apart from the request lifecycle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from ..buffer import KVCacheBuffer
from ..context import cache_context
from ..metrics import KVCacheMetrics
from ..params import AnyKVCacheParams, MultiKVCacheParams
from ..tiers import TierMetrics, TierUsage
from ..validation import check_request_id
from .batch_resolution import BatchResolver
from .replica import Replica
from .reservation import device_prefix_hits


class PagedCacheQueries:
    """Device buffers, page counts, occupancy, admission control and metrics per replica."""

    _replicas: list[Replica]
    _requests: BatchResolver
    params: AnyKVCacheParams
    page_size: int
    total_num_pages: int
    total_num_host_pages: int

    def get_device_buffer(self, replica_idx: int = 0) -> KVCacheBuffer | dict[str, KVCacheBuffer]:
        """The replica's page tensors (one per TP shard, with their scales
        tensors when quantized); for a `MultiKVCacheParams`, one
        `KVCacheBuffer` per leaf cache by name."""
        buffers = self._requests.replica(replica_idx).buffers
        if isinstance(self.params, MultiKVCacheParams):
            return dict(buffers)
        (buffer,) = buffers.values()
        return buffer

    def get_req_blocks(self, request_id: Hashable, replica_idx: int = 0) -> list[int]:
        """The request's page ids, in token order."""
        return self._requests.claimed_on(request_id, replica_idx).pages_of(request_id)

    def get_num_pages(self, replica_idx: int = 0) -> int:
        """Device pages of the replica (the null page not counted):
        `total_num_pages`, which `total_num_blocks` also returns."""
        self._requests.replica(replica_idx)
        return self.total_num_pages

    def get_num_used_pages(self, replica_idx: int = 0) -> int:
        """Device pages some request holds."""
        return self.total_num_pages - self._requests.replica(replica_idx).pool.num_free

    def get_num_host_pages(self, replica_idx: int = 0) -> int:
        """Host-tier pages of the replica."""
        self._requests.replica(replica_idx)
        return self.total_num_host_pages

    def get_num_used_host_pages(self, replica_idx: int = 0) -> int:
        """Host-tier pages holding an evicted device page."""
        host = self._requests.replica(replica_idx).host
        return 0 if host is None else host.num_used

    def get_num_disk_pages(self, replica_idx: int = 0) -> int:
        """Pages the disk tier's budget holds (0 without a disk tier)."""
        usage = self.get_tier_usage(replica_idx).get("disk")
        return 0 if usage is None else usage.total_pages

    def get_num_used_disk_pages(self, replica_idx: int = 0) -> int:
        """Page files of the disk tier this process knows of (its own, those
        found at start-up and those it hit)."""
        usage = self.get_tier_usage(replica_idx).get("disk")
        return 0 if usage is None else usage.used_pages

    def get_tier_usage(self, replica_idx: int = 0) -> dict[str, TierUsage]:
        """Occupancy of each lower tier of the replica, by tier name, in lookup order."""
        return {tier.name: tier.usage() for tier in self._requests.replica(replica_idx).tiers}

    def num_free_blocks(self, replica_idx: int = 0) -> int:
        """Pages no request holds (free or cached) on the replica."""
        return self._requests.replica(replica_idx).pool.num_free

    def total_num_blocks(self, replica_idx: int = 0) -> int:
        """Pages of the replica's pool: `get_num_pages` under MAX's other name for it."""
        return self.get_num_pages(replica_idx)

    def get_device_prefix_pages(self, ctx: object) -> list[int]:
        """Per replica, how many leading pages of `ctx`, as a new request, its
        device prefix cache would serve if the request were claimed there now;
        changes nothing. For placing a request where its prefix is warmest
        (lower tiers are not asked: their lookups read whole page records)."""
        data = cache_context(ctx)
        check_request_id(data.request_id)
        return [len(device_prefix_hits(replica, data)) for replica in self._replicas]

    def get_pct_used_blocks_after_allocation(self, ctx: object, replica_idx: int = 0) -> float:
        """Fraction (0..1, capped) of the replica's pages in use if `ctx` got all
        the pages its tokens need now, ignoring prefix hits; for admission control."""
        data = cache_context(ctx)
        replica = self._requests.replica(replica_idx)
        check_request_id(data.request_id)
        state = replica.requests.get(data.request_id)
        held = state.num_pages if state is not None else 0
        needed = max(0, -(-data.current_length // self.page_size) - held)
        used = self.total_num_pages - replica.pool.num_free
        return min(1.0, (used + needed) / self.total_num_pages)

    # ----------------------------------------------------------------- metrics

    def get_metrics_aggregated(self) -> KVCacheMetrics:
        """Metrics summed over replicas."""
        return sum((r.metrics for r in self._replicas), KVCacheMetrics())

    def get_cache_tokens_by_salt(self) -> dict[str | None, int]:
        """Tokens served from cache, summed over replicas, per cache salt (None: unsalted)."""
        out: Counter[str | None] = Counter()
        for replica in self._replicas:
            out.update(replica.cache_tokens_by_salt)
        return dict(out)

    def reset_metrics(self) -> None:
        """Zeroes every replica's metrics and per-salt counts (the tiers'
        counters in `get_tier_metrics` keep counting)."""
        for replica in self._replicas:
            replica.metrics = KVCacheMetrics()
            replica.cache_tokens_by_salt.clear()

    def get_tier_metrics(self) -> dict[str, TierMetrics]:
        """Each lower tier's counters summed over replicas, by tier name."""
        out: dict[str, TierMetrics] = {}
        for replica in self._replicas:
            for tier in replica.tiers:
                out[tier.name] = out.get(tier.name, TierMetrics()) + tier.metrics
        return out

"""mokv's cache counters as MAX's scheduler reports them (`max.nn.kv_cache.metrics.KVCacheMetrics`).

MAX's serving loop reads the manager's metrics after every batch
(`take_metrics_aggregated`: read and clear) and exports them to Prometheus.
mokv keeps cumulative counters (the manager's `KVCacheMetrics`, each tier's
`TierMetrics`); the MAX figures are derived from them:

- `input_tokens`, `cache_tokens`: mokv's, as they are (cache tokens count
  hits from every tier).
- `device_blocks_served`: pages served from cache less those loaded from a
  lower tier.
- `h2d_bytes_copied` / `d2h_bytes_copied`: the host tier's loaded / saved
  bytes; `disk_bytes_read` / `disk_bytes_written`: the disk tier's. The
  remote tier has no MAX counter of its own; its hits show in
  `cache_tokens` and in the scheduler's external-tier hit tokens.

`MetricsWindow` turns the cumulative figures into MAX's windows (since the
last read-and-clear) without clearing mokv's counters.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from max.nn.kv_cache.metrics import KVCacheMetrics as MaxKVCacheMetrics

from ..metrics import KVCacheMetrics
from ..tiers import TierMetrics


@dataclass(frozen=True)
class CacheCounters:
    """The cumulative figures MAX's metrics are made of."""

    input_tokens: int = 0
    cache_tokens: int = 0
    device_blocks_served: int = 0
    h2d_bytes_copied: int = 0
    d2h_bytes_copied: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def as_max(self) -> MaxKVCacheMetrics:
        """These figures as MAX's `KVCacheMetrics` (its other fields zero)."""
        return MaxKVCacheMetrics(**{f.name: getattr(self, f.name) for f in fields(self)})


def cache_counters(metrics: KVCacheMetrics, tiers: dict[str, TierMetrics], page_size: int) -> CacheCounters:
    """MAX's figures from a manager's counters and its tiers' (by tier name)."""
    host = tiers.get("host", TierMetrics())
    disk = tiers.get("disk", TierMetrics())
    tier_pages = sum(tier.hit_pages for tier in tiers.values())
    return CacheCounters(
        input_tokens=metrics.input_tokens,
        cache_tokens=metrics.cache_tokens,
        device_blocks_served=metrics.cache_tokens // page_size - tier_pages,
        h2d_bytes_copied=host.hit_bytes,
        d2h_bytes_copied=host.saved_bytes,
        disk_bytes_read=disk.hit_bytes,
        disk_bytes_written=disk.saved_bytes,
    )


class MetricsWindow:
    """Cumulative counters read as MAX's windows: what happened since the last
    `take`, which starts the next window (MAX's managers clear their counters
    there)."""

    def __init__(self) -> None:
        self._taken = CacheCounters()

    def peek(self, now: CacheCounters) -> MaxKVCacheMetrics:
        """The figures of the open window."""
        return (now - self._taken).as_max()

    def take(self, now: CacheCounters) -> MaxKVCacheMetrics:
        """The figures of the open window, and a new window starts."""
        window, self._taken = now - self._taken, now
        return window.as_max()

"""Counters a KV cache manager keeps so callers can see how well the cache works."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self


class Counters:
    """A dataclass of counters that sum field by field (to aggregate replicas)."""

    def __add__(self, other: Self) -> Self:
        if type(other) is not type(self):
            return NotImplemented
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})  # type: ignore[arg-type]


@dataclass
class KVCacheMetrics(Counters):
    """Token and transfer counters of one replica (or, summed, of a manager)."""

    input_tokens: int = 0
    """Tokens the model had to compute (cache misses), counted at each `alloc`."""

    cache_tokens: int = 0
    """Prompt tokens served from the prefix cache (device or host tier)."""

    h2d_blocks_copied: int = 0
    """Pages copied back from the host tier to serve a prefix hit (MAX's field name)."""

    d2h_blocks_copied: int = 0
    """Device pages copied to the lower tiers: evicted ones to the host tier,
    committed ones to the disk and remote tiers (MAX's field name)."""

    @property
    def prompt_tokens(self) -> int:
        """All tokens asked for: computed plus served from cache."""
        return self.input_tokens + self.cache_tokens

    @property
    def cache_hit_rate(self) -> float:
        """Share of `prompt_tokens` served from cache (0.0 when nothing ran)."""
        total = self.prompt_tokens
        return self.cache_tokens / total if total else 0.0

"""KVCacheMetrics: hit rate and replica aggregation."""

from __future__ import annotations

from mokv import KVCacheMetrics


def test_hit_rate_and_addition() -> None:
    a = KVCacheMetrics(input_tokens=30, cache_tokens=10, h2d_blocks_copied=1)
    b = KVCacheMetrics(input_tokens=10, cache_tokens=50, d2h_blocks_copied=2)
    assert a.prompt_tokens == 40 and a.cache_hit_rate == 0.25
    assert a + b == KVCacheMetrics(40, 60, 1, 2)
    assert (a + b).cache_hit_rate == 0.6
    assert KVCacheMetrics().cache_hit_rate == 0.0

"""PagedKVCacheManager's lifecycle and queries with hand-computed expectations:
reserve, dummies, claims across replicas, resetting the prefix cache, page
counts, construction. Allocation, commit and runtime inputs have files of their own.

Defaults (see conftest): page size 4, 16 pages, prefix caching on, runtime
invariant checks on, so every call below also re-checks the pool invariants.
"""

from __future__ import annotations

import pytest
from max.dtype import DType
from max.graph import DeviceRef

from mokv import InsufficientBlocksError, KVCacheParams, KVCacheQuantConfig, PagedKVCacheManager
from tests.support.small_cache import MakeManager, ctx, lookup, run_request


def test_reserve_releases_on_exit_and_on_error(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(9)), ctx("b", range(5))
    with m.reserve([[a, b]]):
        assert m.contains("a") and m.contains("b")
        assert m.get_req_blocks("a") == [0, 1, 2] and m.get_req_blocks("b") == [3, 4]
        m.runtime_inputs([[a, b]])
    assert not m.contains("a") and not m.contains("b") and m.num_free_blocks() == 16
    with pytest.raises(InsufficientBlocksError), m.reserve([[ctx("c", range(40)), ctx("d", range(40))]]):
        pass  # pragma: no cover - d does not fit
    assert not m.contains("c") and not m.contains("d") and m.num_free_blocks() == 16


def test_alloc_dummy_points_at_the_null_page(make_manager: MakeManager) -> None:
    m = make_manager()
    m.alloc_dummy("pad")
    assert m.contains("pad") and m.get_req_blocks("pad") == [16]
    assert m.num_free_blocks() == 16
    cache_lengths, table, _ = lookup(m, [ctx("pad", [0])])
    assert table.tolist() == [[16]] and cache_lengths.tolist() == [0]
    with pytest.raises(ValueError, match="'pad' is a dummy"):
        m.alloc(ctx("pad", [0]))
    m.step([[ctx("pad", [0, 1])]])
    m.release("pad")
    assert not m.contains("pad") and m.num_free_blocks() == 16


def test_claims_are_checked(make_manager: MakeManager) -> None:
    m = make_manager(data_parallel_degree=2)
    m.claim("a", 1)
    with pytest.raises(ValueError, match="'a' is already claimed on replica 1"):
        m.claim("a", 0)
    with pytest.raises(ValueError, match="'a' is claimed on replica 1, not on replica 0"):
        m.alloc(ctx("a", [1]), 0)
    with pytest.raises(ValueError, match="'b' is not claimed, not on replica 0"):
        m.release("b", 0)
    with pytest.raises(ValueError, match="replica_idx=2 is out of range: there are 2 replicas"):
        m.claim("c", 2)
    assert m.contains("a", 1) and not m.contains("a", 0)


def test_replicas_have_separate_pools(make_manager: MakeManager) -> None:
    m = make_manager(data_parallel_degree=2)
    a0, a1, b1 = ctx("a0", range(200, 209)), ctx("a1", range(9)), ctx("b1", range(5))
    m.claim("a0", 0)
    m.claim("a1", 1)
    m.claim("b1", 1)
    m.alloc(a0, 0)
    m.alloc(a1, 1)
    m.alloc(b1, 1)
    assert m.get_req_blocks("a0", 0) == [0, 1, 2]
    assert m.get_req_blocks("a1", 1) == [0, 1, 2] and m.get_req_blocks("b1", 1) == [3, 4]
    assert (m.num_free_blocks(0), m.num_free_blocks(1)) == (13, 11)
    r0, r1 = m.runtime_inputs([[a0], [a1, b1]]).inputs
    assert r0.blocks is m.get_device_buffer(0).values[0] and r1.blocks is m.get_device_buffer(1).values[0]
    assert r0.blocks is not r1.blocks
    assert r0.lookup_table.shape == (1, 3) and r1.lookup_table.shape == (2, 3)
    for c in (a0, a1, b1):
        c.update(5)
    m.step([[a0], [a1, b1]])
    m.release("a1", 1)
    assert m.get_req_blocks("b1", 1) == [0, 4]  # b1's first page deduped into a1's
    # a1's prefix is cached on replica 1 only.
    c0, c1 = ctx("c0", range(9)), ctx("c1", range(9))
    m.claim("c0", 0)
    m.alloc(c0, 0)
    m.claim("c1", 1)
    m.alloc(c1, 1)
    assert c0.processed_length == 0 and c1.processed_length == 8
    assert m.get_metrics_aggregated().cache_tokens == 8


def test_reset_prefix_cache_drops_only_unheld_pages(make_manager: MakeManager) -> None:
    m = make_manager()
    a = ctx("a", range(9))
    m.claim("a")
    m.alloc(a)
    a.update(1)
    m.step([[a]])  # a holds committed pages 0, 1
    run_request(m, ctx("q", range(50, 59)))  # caches q's pages, then frees them
    m.reset_prefix_cache()
    q2 = ctx("q2", range(50, 59))
    m.claim("q2")
    m.alloc(q2)
    assert q2.processed_length == 0
    p = ctx("p", range(9))
    m.claim("p")
    m.alloc(p)
    assert p.processed_length == 8 and m.get_req_blocks("p")[:2] == [0, 1]


def test_pct_used_pages_after_allocation(make_manager: MakeManager) -> None:
    m = make_manager()
    a = ctx("a", range(9))
    assert m.get_pct_used_blocks_after_allocation(a) == 3 / 16
    m.claim("a")
    m.alloc(a)
    assert m.get_pct_used_blocks_after_allocation(ctx("b", range(20))) == (3 + 5) / 16
    assert m.get_pct_used_blocks_after_allocation(a) == 3 / 16
    assert m.get_pct_used_blocks_after_allocation(ctx("c", range(100))) == 1.0


def test_page_counts(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=10)
    assert (m.get_num_pages(0), m.total_num_blocks(0), m.get_num_used_pages(0)) == (10, 10, 0)
    assert (m.get_num_host_pages(0), m.get_num_used_host_pages(0)) == (0, 0)
    assert (m.get_num_disk_pages(0), m.get_num_used_disk_pages(0)) == (0, 0)
    buffer = m.get_device_buffer(0)
    assert (buffer.total_num_pages, buffer.num_physical_pages) == (10, 11)
    assert not buffer.to_memory()[0].buffer.to_numpy().any()


def test_constructor_validation(make_manager: MakeManager) -> None:
    with pytest.raises(ValueError, match="total_num_pages must be >= 1, got 0"):
        make_manager(total_num_pages=0)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        make_manager(max_batch_size=0)
    with pytest.raises(ValueError, match="total_num_host_pages=4 needs enable_prefix_caching=True"):
        make_manager(prefix_caching=False, total_num_host_pages=4)


def test_a_quantized_cache_allocates_scales_beside_every_shards_pages() -> None:
    """Two replicas of two TP shards: every shard gets its zeroed float32
    scales, paged like its int8 pages (null page included), and the host
    tier's pages hold the scales too."""
    cpu = DeviceRef.CPU()
    params = KVCacheParams(
        DType.int8,
        n_kv_heads=4,
        head_dim=8,
        num_layers=2,
        page_size=4,
        enable_prefix_caching=True,
        data_parallel_degree=2,
        devices=[cpu] * 4,
        kvcache_quant_config=KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=2),
    )
    m = PagedKVCacheManager(params, None, 8, total_num_host_pages=3, max_batch_size=2)
    for replica in range(2):
        buffer = m.get_device_buffer(replica)
        assert [(list(v.shape), v.dtype) for v in buffer.values] == [([9, 2, 2, 4, 2, 8], DType.int8)] * 2
        assert buffer.scales is not None
        assert [(list(s.shape), s.dtype) for s in buffer.scales] == [([9, 2, 2, 2, 2, 2], DType.float32)] * 2
        assert all(s.device == v.device for s, v in zip(buffer.scales, buffer.values, strict=True))
        assert not any(s.to_numpy().any() for s in buffer.scales)
    # A host page holds one page of both shards: (4 tokens x K,V x 2 layers x 2 heads x 8 bytes)
    # plus (2 scale rows x K,V x 2 layers x 2 heads x 2 float32 scales), twice.
    host_page = 2 * (4 * 2 * 2 * 2 * 8 + 2 * 2 * 2 * 2 * 2 * 4)
    assert m.get_tier_usage(0)["host"].total_bytes == 3 * host_page

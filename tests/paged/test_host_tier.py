"""The host tier: evicted cached pages go to host pages and come back on a hit,
bytes intact, with the copies counted in the metrics."""

from __future__ import annotations

import numpy as np

from mokv import PagedKVCacheManager, TextContext
from tests.support.small_cache import MakeManager, ctx


def fill(m: PagedKVCacheManager, request_id: str, base: float) -> None:
    """Stands in for the model: writes `base + i` into the i-th page of the request."""
    pages = m.get_device_buffer(0).values[0].to_numpy()
    for i, page in enumerate(m.get_req_blocks(request_id)):
        pages[page] = base + i


def prefill_and_release(m: PagedKVCacheManager, c: TextContext, base: float) -> None:
    m.claim(c.request_id)
    m.alloc(c)
    fill(m, c.request_id, base)
    c.update(0)
    m.step([[c]])
    m.release(c.request_id)


def test_evicted_pages_come_back_from_the_host(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=4, total_num_host_pages=8)
    prefill_and_release(m, ctx("a", range(8)), base=10.0)  # commits pages 0 and 1
    assert m.get_metrics_aggregated().d2h_blocks_copied == 0
    # A request that needs every page evicts a's cached pages to the host.
    big = ctx("big", np.arange(100, 116))
    m.claim("big")
    m.alloc(big)
    assert m.get_metrics_aggregated().d2h_blocks_copied == 2
    assert m.get_num_used_host_pages(0) == 2
    fill(m, "big", base=-1.0)  # overwrite the device copies
    m.release("big")

    again = ctx("again", range(9))
    m.claim("again")
    m.alloc(again)
    metrics = m.get_metrics_aggregated()
    assert metrics.h2d_blocks_copied == 2 and again.processed_length == 8
    assert metrics.cache_tokens == 8
    pages = m.get_device_buffer(0).values[0].to_numpy()
    first, second, _ = m.get_req_blocks("again")
    assert (pages[first] == 10.0).all() and (pages[second] == 11.0).all()
    # The restored pages are device-cached again: a second request hits on the device.
    other = ctx("other", range(9))
    m.claim("other")
    m.alloc(other)
    assert m.get_metrics_aggregated().h2d_blocks_copied == 2
    assert m.get_req_blocks("other")[:2] == [first, second]


def test_host_pages_are_evicted_least_recently_used(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=2, total_num_host_pages=2)
    prompts = {i: range(100 * i, 100 * i + 5) for i in range(4)}  # one cacheable page each
    for i in range(4):
        prefill_and_release(m, ctx(f"p{i}", prompts[i]), base=float(i))
    # Each prefill evicted the previous prompt's page to the host; the third
    # offload pushed p0 out of the two host pages.
    assert m.get_metrics_aggregated().d2h_blocks_copied == 3
    assert m.get_num_used_host_pages(0) == 2

    def hit(i: int) -> int:
        c = ctx(f"q{i}", prompts[i])
        m.claim(c.request_id)
        m.alloc(c)
        m.release(c.request_id)
        return c.processed_length

    # q1 restores p1 from the host; its allocation evicts p3 from the device,
    # whose offload evicts p2 (p1 is pinned while it is being restored).
    assert [hit(1), hit(0), hit(2), hit(3)] == [4, 0, 0, 4]
    metrics = m.get_metrics_aggregated()
    # q2's allocation evicted p1's page again, which the host already held.
    assert (metrics.d2h_blocks_copied, metrics.h2d_blocks_copied) == (4, 2)


def test_an_already_offloaded_page_is_not_copied_twice(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=2, total_num_host_pages=4)
    prefill_and_release(m, ctx("a", range(5)), base=1.0)  # page 0 cached
    for i in range(3):  # churn: evict a's page, then bring it back from the host
        prefill_and_release(m, ctx(f"x{i}", range(50 + 10 * i, 58 + 10 * i)), base=0.0)
        b = ctx(f"b{i}", range(5))
        m.claim(b.request_id)
        m.alloc(b)
        assert b.processed_length == 4
        m.release(b.request_id)
    metrics = m.get_metrics_aggregated()
    assert metrics.h2d_blocks_copied == 3
    # a's page went to the host once (later evictions found it there); each
    # x's two pages were copied when b's allocation evicted them.
    assert metrics.d2h_blocks_copied == 1 + 2 * 3


def test_reset_prefix_cache_empties_the_host(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=2, total_num_host_pages=4)
    prefill_and_release(m, ctx("a", range(5)), base=1.0)
    prefill_and_release(m, ctx("b", range(50, 58)), base=2.0)
    assert m.get_num_used_host_pages(0) == 1
    m.reset_prefix_cache()
    assert m.get_num_used_host_pages(0) == 0
    c = ctx("c", range(5))
    m.claim("c")
    m.alloc(c)
    assert c.processed_length == 0

"""PagedKVCacheManager.alloc with hand-computed expectations: which pages a
request gets, prefix hits, the free queue's eviction order, and refusals.

Defaults (see conftest): page size 4, 16 pages, prefix caching on, runtime
invariant checks on, so every call below also re-checks the pool invariants.
"""

from __future__ import annotations

import numpy as np
import pytest

from mokv import InsufficientBlocksError, TextContext
from tests.support.small_cache import MakeManager, ctx, run_request


def test_first_request_gets_the_first_pages(make_manager: MakeManager) -> None:
    m = make_manager()
    c = ctx("a", range(10))
    m.claim("a")
    m.alloc(c)
    assert m.get_req_blocks("a") == [0, 1, 2]
    assert m.num_free_blocks() == 13 and m.get_num_used_pages() == 3
    assert c.processed_length == 0 and c.active_length == 10


def test_pages_are_reused_after_release(make_manager: MakeManager) -> None:
    m = make_manager()
    run_request(m, ctx("a", range(10)))  # commits pages 0, 1 (tokens 0..7)
    b = ctx("b", range(10))
    m.claim("b")
    m.alloc(b)
    # Pages came back tail first: the queue is 3..15, then 2, 1, 0.
    assert m.get_req_blocks("b") == [0, 1, 3]
    assert (b.processed_length, b.active_length) == (8, 2)
    metrics = m.get_metrics_aggregated()
    # a: 10 prompt + 1 decode token computed; b: 2 computed, 8 from cache.
    assert (metrics.input_tokens, metrics.cache_tokens) == (13, 8)
    assert metrics.cache_hit_rate == pytest.approx(8 / 21)


def test_the_last_token_is_never_served_from_cache(make_manager: MakeManager) -> None:
    m = make_manager()
    run_request(m, ctx("a", range(8)))  # 8 prompt tokens, both pages committed after a step
    b = ctx("b", range(8))
    m.claim("b")
    m.alloc(b)
    # Only page 0 is hashable for b: its page 1 ends with b's last token.
    assert b.processed_length == 4 and b.active_length == 4
    assert m.get_req_blocks("b")[0] == 0


def test_decode_grows_one_page_per_page(make_manager: MakeManager) -> None:
    m = make_manager(page_size=4, prefix_caching=False)
    c = ctx("a", [1, 2, 3])
    m.claim("a")
    m.alloc(c)
    counts = []
    for t in range(14):
        c.update(t)
        m.alloc(c)
        counts.append(len(m.get_req_blocks("a")))
    # 4..17 tokens: a new page exactly when the length passes a multiple of 4.
    assert counts == [-(-n // 4) for n in range(4, 18)]
    assert m.get_req_blocks("a") == [0, 1, 2, 3, 4]


def test_exact_eviction_order(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=6)
    run_request(m, ctx("a", range(9)))  # a: pages 0,1,2; commits 0 and 1
    # Free queue: 3, 4, 5, then a's pages tail first: 2, 1, 0.
    c = ctx("c", np.arange(100, 116))
    m.claim("c")
    m.alloc(c)
    assert m.get_req_blocks("c") == [3, 4, 5, 2]
    d = ctx("d", [200])
    m.claim("d")
    m.alloc(d)
    assert m.get_req_blocks("d") == [1]  # a's tail is evicted before its head
    m.release("c")  # queue: 0, then c's pages tail first: 2, 5, 4, 3
    e = ctx("e", range(9))
    m.claim("e")
    m.alloc(e)
    assert m.get_req_blocks("e") == [0, 2, 5] and e.processed_length == 4
    assert m.get_metrics_aggregated().cache_tokens == 4


def test_a_hit_moves_the_page_to_the_back_of_the_queue(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=4)
    run_request(m, ctx("a", range(5)))  # a: pages 0, 1; commits 0
    run_request(m, ctx("b", range(5)))  # b hits page 0, takes page 2
    # Queue was 2, 3, 1, 0; b took 0 and 2 and gave back 2 then 0.
    c = ctx("c", np.arange(50, 58))
    m.claim("c")
    m.alloc(c)
    assert m.get_req_blocks("c") == [3, 1]


def test_hit_rate_on_repeated_prompts(make_manager: MakeManager) -> None:
    m = make_manager(page_size=4, total_num_pages=32)
    prompt = np.arange(21)
    for i in range(5):
        run_request(m, ctx(f"r{i}", prompt), decode=0 if i else 1)
    # r0 computes 21 + 1 tokens and commits 5 pages; r1..r4 each reuse the
    # 5 pages before the last token and compute 1.
    metrics = m.get_metrics_aggregated()
    assert (metrics.input_tokens, metrics.cache_tokens) == (22 + 4, 4 * 20)
    assert metrics.cache_hit_rate == pytest.approx(80 / 106)
    m.reset_metrics()
    assert m.get_metrics_aggregated().cache_hit_rate == 0.0


def test_out_of_pages_error_names_the_numbers(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=4)
    m.claim("long")
    with pytest.raises(
        InsufficientBlocksError,
        match=r"needs 17 tokens of KV \(current_length 17, num_steps=1\) but a replica holds only 16 \(4 pages of 4",
    ):
        m.alloc(ctx("long", range(17)))
    m.claim("a")
    m.alloc(ctx("a", range(12)))
    b = ctx("b", range(100, 108))
    m.claim("b")
    with pytest.raises(
        InsufficientBlocksError,
        match=r"'b' needs 2 new pages on replica 0 but only 1 are free \(3/4 in use\)",
    ):
        m.alloc(b)
    assert m.get_req_blocks("b") == [] and m.num_free_blocks() == 1
    assert m.get_metrics_aggregated().input_tokens == 12


def test_failed_alloc_keeps_the_request_and_metrics(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=6)
    run_request(m, ctx("a", range(9)))  # caches pages 0, 1; queue: 3, 4, 5, 2, 1, 0
    m.claim("x")
    m.alloc(ctx("x", np.arange(50, 58)))  # takes 3 and 4
    b = ctx("b", range(20))  # would hit 0 and 1, then need 3 more of the 2 left over
    m.claim("b")
    before = m.get_metrics_aggregated()
    with pytest.raises(InsufficientBlocksError, match=r"needs 3 new pages .* only 2 are free \(2/6 in use\)"):
        m.alloc(b)
    assert b.processed_length == 0 and m.get_req_blocks("b") == []
    assert m.num_free_blocks() == 4 and m.get_metrics_aggregated() == before
    m.release("x")
    m.alloc(b)  # the cached pages are still there
    assert m.get_req_blocks("b")[:2] == [0, 1] and b.processed_length == 8


def test_failed_alloc_refreshes_its_prefix_hits(make_manager: MakeManager) -> None:
    """MAX's manager touches the cached pages a failed allocation matched, so
    they move to the most-recently-used end of the free queue (tail first)
    and outlive the pages behind them; the retry then finds the whole prefix."""
    m = make_manager(page_size=1, total_num_pages=10)
    g = ctx("g", [30, 31])
    m.claim("g")
    m.alloc(g)  # pages 0, 1
    a = ctx("a", [1, 2, 3, 4])
    m.claim("a")
    m.alloc(a)  # pages 2..5
    a.update(5)
    m.step([[a]])  # commits 2..5
    m.release("a")
    m.release("g")  # queue: 6, 7, 8, 9, 5, 4, 3, 2, 1, 0
    m.claim("h")
    m.alloc(ctx("h", [20, 21, 22, 23]))  # 6..9
    c = ctx("c", [1, 2, 3, 4, 40, 41, 42])
    m.claim("c")
    with pytest.raises(InsufficientBlocksError, match="needs 3 new pages"):
        m.alloc(c)  # hits 2..5, needs 3 more of the 2 left
    assert c.processed_length == 0 and m.get_req_blocks("c") == []
    assert m._replicas[0].pool.free_order() == [1, 0, 5, 4, 3, 2]
    m.claim("d")
    m.alloc(ctx("d", [60, 61]))
    assert m.get_req_blocks("d") == [1, 0]  # not the cached prefix's 5 and 4
    m.release("h")
    m.alloc(c)
    assert c.processed_length == 4 and m.get_req_blocks("c")[:4] == [2, 3, 4, 5]


@pytest.mark.parametrize("page_size", [1, 3, 16, 128])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_no_leak_after_a_random_workload(make_manager: MakeManager, page_size: int, prefix_caching: bool) -> None:
    rng = np.random.default_rng(page_size)
    total = 4096 // page_size + 8
    m = make_manager(page_size, total, prefix_caching=prefix_caching, max_batch_size=64)
    prefixes = [rng.integers(0, 5, size=rng.integers(1, 300)) for _ in range(3)]
    live: dict[str, TextContext] = {}
    for i in range(200):
        if live and (rng.random() < 0.3 or len(live) >= 12):
            rid = list(live)[rng.integers(len(live))]
            m.release(rid)
            del live[rid]
            continue
        if live and rng.random() < 0.5:
            batch = list(live.values())
            m.runtime_inputs([batch])
            for c in batch:
                c.update(int(rng.integers(0, 5)))
            m.step([batch])
            for c in batch:
                try:
                    m.alloc(c)
                except InsufficientBlocksError:
                    m.release(c.request_id)
                    del live[c.request_id]
            continue
        prompt = np.concatenate([prefixes[rng.integers(3)], rng.integers(0, 5, size=rng.integers(1, 40))])
        c = ctx(f"r{i}", prompt)
        m.claim(c.request_id)
        try:
            m.alloc(c)
            live[c.request_id] = c
        except InsufficientBlocksError:
            m.release(c.request_id)
    for rid in live:
        m.release(rid)
    assert m.num_free_blocks() == total and m.get_num_used_pages() == 0
    if prefix_caching:
        assert m.get_metrics_aggregated().cache_tokens > 0

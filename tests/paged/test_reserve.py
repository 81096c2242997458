"""`reserve` grants exactly what `claim` + `alloc` of each request in turn grant,
prefix hits included, and a refused reservation leaves every page, ref count,
cached entry, table row and metric as it was (`tests.support.manager_state`).

The reference is the manager itself: each reservation below is also played as
plain claim + alloc calls on a twin manager driven through the same history.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mokv import InsufficientBlocksError, PagedKVCacheManager, TextContext
from tests.support.manager_state import paged_snapshot
from tests.support.small_cache import ctx, small_paged_manager


def committed(m: PagedKVCacheManager, rid: str, tokens: list[int]) -> TextContext:
    """Runs `tokens` through one model step for `rid` (claim, alloc, step) and
    keeps the request: every full page it computed is committed and held."""
    c = ctx(rid, tokens)
    m.claim(rid)
    m.alloc(c)
    c.update(9999)
    m.step([[c]])
    return c


def claim_and_alloc_fits(m: PagedKVCacheManager, contexts: list[TextContext]) -> bool:
    """Whether claim + alloc of each context in turn succeeds (released again either way)."""
    done: list[str] = []
    try:
        for c in contexts:
            m.claim(c.request_id)
            done.append(c.request_id)
            m.alloc(c)
        return True
    except InsufficientBlocksError:
        return False
    finally:
        for rid in reversed(done):
            m.release(rid)


def test_the_issue_42_case_a_prefix_hit_makes_room() -> None:
    # Page size 2, 4 pages; `a` holds 3 committed pages (6 prompt tokens + 1).
    m = small_paged_manager(page_size=2, total_num_pages=4)
    committed(m, "a", [1, 2, 3, 4, 5, 6])
    assert m.get_req_blocks("a") == [0, 1, 2] and m.num_free_blocks() == 1
    twin = small_paged_manager(page_size=2, total_num_pages=4)
    committed(twin, "a", [1, 2, 3, 4, 5, 6])
    assert claim_and_alloc_fits(twin, [ctx("b", [1, 2, 3, 4, 5, 6])])
    b = ctx("b", [1, 2, 3, 4, 5, 6])
    with m.reserve([[b]]):
        # b shares a's first two pages (4 tokens; the last token's page is never a hit).
        assert m.get_req_blocks("b")[:2] == m.get_req_blocks("a")[:2]
        assert b.processed_length == 4 and b.active_length == 2
    assert not m.contains("b")


def test_issue_case_with_a_free_page_fewer_is_refused_and_changes_nothing() -> None:
    m = small_paged_manager(page_size=2, total_num_pages=4)
    committed(m, "a", [1, 2, 3, 4, 5, 6])
    m.claim("x")
    m.alloc(ctx("x", [7]))  # the one free page is taken: b would need one new page
    before = paged_snapshot(m)
    b = ctx("b", [1, 2, 3, 4, 5, 6])
    with (
        pytest.raises(InsufficientBlocksError, match=r"'b' needs 1 new pages on replica 0 \(2 of its 3"),
        m.reserve([[b]]),
    ):
        pass  # pragma: no cover - refused
    assert paged_snapshot(m) == before
    assert (b.processed_length, b.active_length, b.cached_prefix_length) == (0, 6, None)
    assert not m.contains("b") and m.contains("a") and m.contains("x")


def _cached_history(m: PagedKVCacheManager) -> None:
    """Page size 4, 16 pages: `p` and `q` (13 tokens each) finished, leaving
    three cached, unheld pages each in the free queue (later fresh pages
    evict them); `r` (13 tokens) still holds its 4 pages, 3 of them cached."""
    for rid, start in (("p", 0), ("q", 100), ("r", 200)):
        c = committed(m, rid, list(range(start, start + 13)))
        if rid != "r":
            m.release(c.request_id)
    assert m.num_free_blocks() == 12


CASES: dict[str, Callable[[], list[TextContext]]] = {
    # Hits on pages `r` holds cost no free page: 5 + 7 new pages fit in 12
    # (counted without hits, 8 + 7 would not).
    "hits on held pages": lambda: [ctx("g", list(range(200, 229))), ctx("k", list(range(300, 328)))],
    # Hits on cached, unheld pages take them off the free queue.
    "hits on unheld and held pages": lambda: [ctx("h", list(range(13))), ctx("i", list(range(200, 213)))],
    # The first request's 9 fresh pages evict the pages the second would have hit.
    "eviction by an earlier request": lambda: [ctx("e", list(range(300, 333))), ctx("f", list(range(13)))],
    # Two requests sharing a cached prefix take its unheld pages once.
    "shared hits": lambda: [ctx("s", list(range(13))), ctx("t", [*range(12), 77, 78, 79])],
    # Under a salt, `r`'s held pages are no hits: 4 + 9 new pages, one too many
    # (unsalted, 1 + 9 would fit).
    "salted twin of held pages": lambda: [
        TextContext("w", np.arange(200, 213), cache_salt="tenant"),
        ctx("x", list(range(300, 333))),
    ],
    "too long": lambda: [ctx("l", list(range(1000, 1065)))],
    "one page too many": lambda: [ctx("u", list(range(300, 340))), ctx("v", list(range(400, 410)))],
}


@pytest.mark.parametrize("case", list(CASES))
def test_reserve_grants_what_claim_and_alloc_grant(case: str) -> None:
    m, twin = small_paged_manager(), small_paged_manager()
    for manager in (m, twin):
        _cached_history(manager)
    fits = claim_and_alloc_fits(twin, CASES[case]())
    before = paged_snapshot(m)
    contexts = CASES[case]()
    if fits:
        with m.reserve([contexts]):
            for c in contexts:
                assert m.contains(c.request_id)
                held = m.get_req_blocks(c.request_id)
                assert len(held) == -(-c.current_length // 4)
        assert not any(m.contains(c.request_id) for c in contexts)
    else:
        with pytest.raises(InsufficientBlocksError, match="reserve refused: request"), m.reserve([contexts]):
            pass  # pragma: no cover - refused
        assert paged_snapshot(m) == before
        assert all(c.processed_length == 0 for c in contexts)


def test_both_outcomes_are_exercised() -> None:
    outcomes = set()
    for case in CASES:
        twin = small_paged_manager()
        _cached_history(twin)
        outcomes.add(claim_and_alloc_fits(twin, CASES[case]()))
    assert outcomes == {True, False}


def test_a_reserved_request_must_be_new() -> None:
    m = small_paged_manager()
    c = ctx("n", np.arange(9))
    c.update(1)
    before = paged_snapshot(m)
    with pytest.raises(ValueError, match="'n' has processed_length 9"), m.reserve([[c]]):
        pass  # pragma: no cover - refused
    assert paged_snapshot(m) == before

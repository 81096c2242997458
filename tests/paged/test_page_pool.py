"""The page pool: LRU free queue, ref counts, prefix index and its verification."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mokv.paged.page_pool import PagePool
from mokv.prefix import NO_UID, PageHasher, PageIndex

PS = 2
HASHER = PageHasher(PS)


def commit_chain(pool: PagePool, pages: list[int], tokens: np.ndarray) -> list[int]:
    """Commits `pages` as one request's chain over `tokens`; returns the uids."""
    hashes = HASHER.hash_pages(tokens)
    uids, parent_uid, parent_hash = [], NO_UID, None
    for page, page_hash, row in zip(pages, hashes, tokens.reshape(-1, PS), strict=True):
        parent_uid = pool.commit(page, page_hash, parent_uid, parent_hash, row)
        parent_hash = page_hash
        uids.append(parent_uid)
    return uids


def test_fresh_pool_hands_out_pages_in_order() -> None:
    pool = PagePool(6, PS)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 3
    assert pool.ref_count[:4] == [1, 1, 1, 0]


def test_freed_pages_go_to_the_back_in_the_order_given() -> None:
    pool = PagePool(5, PS)
    pool.allocate(3)
    pool.free([2, 1, 0])  # tail first, as a manager releases a request
    assert pool.free_order() == [3, 4, 2, 1, 0]
    assert pool.allocate(4) == [3, 4, 2, 1]


def test_touch_takes_a_cached_page_out_of_the_middle() -> None:
    pool = PagePool(4, PS)
    pool.allocate(4)
    pool.free([0, 1, 2, 3])
    pool.touch([2])
    pool.touch([2])
    assert pool.free_order() == [0, 1, 3]
    pool.free([2])
    assert pool.free_order() == [0, 1, 3]  # still held once
    pool.free([2])
    assert pool.free_order() == [0, 1, 3, 2]


def test_freeing_an_unheld_page_is_an_error() -> None:
    pool = PagePool(2, PS)
    with pytest.raises(ValueError, match="page 1 freed more often than it was held"):
        pool.free([1])
    with pytest.raises(ValueError, match="cannot hand out 3 pages, 2 are free"):
        pool.allocate(3)


def test_eviction_uncommits_and_reports_before_reuse() -> None:
    seen: list[tuple[int, bool]] = []
    pool = PagePool(3, PS)
    pool.on_evict = lambda b: seen.append((b, pool.index.is_committed(b)))
    tokens = np.array([5, 6, 7, 8])
    pool.allocate(2)
    commit_chain(pool, [0, 1], tokens)
    pool.free([1, 0])
    assert pool.allocate(2) == [2, 1]
    assert seen == [(1, True)]  # the callback saw page 1 still committed
    assert not pool.index.is_committed(1)
    assert pool.index.get(HASHER.hash_pages(tokens)[0]) == 0  # the head survives


def test_match_follows_the_chain_and_checks_tokens() -> None:
    pool = PagePool(4, PS)
    tokens = np.array([1, 2, 3, 4, 5, 6])
    pool.allocate(3)
    uids = commit_chain(pool, [0, 1, 2], tokens)
    hashes = HASHER.hash_pages(tokens)
    rows = tokens.reshape(3, PS)
    assert pool.index.match(hashes, NO_UID, rows) == [0, 1, 2]
    assert pool.index.match(hashes[1:], uids[0], rows[1:]) == [1, 2]
    # The wrong parent identity stops the run at once.
    assert pool.index.match(hashes[1:], uids[1], rows[1:]) == []
    # Stored tokens that differ from the request's stop the run there.
    forged = rows.copy()
    forged[1, 0] = 99
    assert pool.index.match(hashes, NO_UID, forged) == [0]


def test_a_colliding_hash_never_matches_other_tokens() -> None:
    pool = PagePool(2, PS)
    pool.allocate(1)
    pool.commit(0, 777, NO_UID, None, np.array([1, 2]))
    assert pool.index.match([777], NO_UID, np.array([[3, 4]])) == []
    assert pool.index.match([777], NO_UID, np.array([[1, 2]])) == [0]


def test_reset_prefix_cache_keeps_held_pages() -> None:
    pool = PagePool(4, PS)
    pool.allocate(2)
    commit_chain(pool, [0, 1], np.array([1, 2, 3, 4]))
    pool.free([1])
    assert pool.reset_prefix_cache() == 1
    assert pool.index.is_committed(0) and not pool.index.is_committed(1)
    assert len(pool.index) == 1


def test_double_commit_is_rejected() -> None:
    index = PageIndex(2, PS)
    index.insert(0, 5, 1, NO_UID, None, np.array([1, 2]))
    with pytest.raises(ValueError, match="already committed to page 0"):
        index.insert(1, 5, 2, NO_UID, None, np.array([1, 2]))
    with pytest.raises(ValueError, match="page 0 is already committed"):
        index.insert(0, 6, 2, NO_UID, None, np.array([1, 2]))


def test_commit_pages_refuses_repeated_or_cached_hashes_and_changes_nothing() -> None:
    pool = PagePool(6, PS)
    pool.allocate(6)
    rows = np.arange(12).reshape(6, PS)
    assert pool.commit_pages([0, 1], [10, 11], [NO_UID, NO_UID], [None, None], rows[:2]) == range(1, 3)
    before = (dict(pool.index._by_hash), list(pool.index.hash), list(pool.index.uid), pool.index.tokens.copy())
    # A hash repeated within the call, and one already cached: refused, nothing written.
    assert pool.commit_pages([2, 3], [12, 12], [NO_UID, NO_UID], [None, None], rows[2:4]) is None
    assert pool.commit_pages([2, 3], [13, 10], [NO_UID, NO_UID], [None, None], rows[2:4]) is None
    after = (dict(pool.index._by_hash), list(pool.index.hash), list(pool.index.uid), pool.index.tokens)
    assert before[:3] == after[:3] and np.array_equal(before[3], after[3])
    # uids keep counting from the last successful commit.
    assert pool.commit_pages([2], [12], [1], [10], rows[2:3]) == range(3, 4)
    assert pool.index.parent_uid[2] == 1 and pool.index.parent_hash[2] == 10


def test_invariant_checks_catch_inconsistencies() -> None:
    pool = PagePool(3, PS)
    pool.allocate(2)
    pool.check_invariants(Counter({0: 1, 1: 1}), HASHER)
    with pytest.raises(AssertionError, match="page 1 has ref count 1 but 2 holders"):
        pool.check_invariants(Counter({0: 1, 1: 2}), HASHER)
    with pytest.raises(AssertionError, match=r"free \(1\) \+ used \(1\) != total \(3\)"):
        pool.check_invariants(Counter({0: 1}), HASHER)
    tokens = np.array([1, 2])
    pool.commit(0, HASHER.hash_pages(tokens)[0], NO_UID, None, tokens)
    pool.check_invariants(Counter({0: 1, 1: 1}), HASHER)
    pool.index.tokens[0, 0] = 9  # the stored tokens no longer hash to the key
    with pytest.raises(AssertionError, match="page 0's tokens hash to"):
        pool.check_invariants(Counter({0: 1, 1: 1}), HASHER)

"""Chained page hashes: the numpy implementation against a per-token Python
reference of the documented recurrence, and the properties prefix caching needs."""

from __future__ import annotations

import numpy as np
import pytest

from mokv.prefix import ROOT, PageHasher

_MASK = (1 << 64) - 1
_Q = 0xFF51AFD7ED558CCD


def reference_hashes(hasher: PageHasher, tokens: np.ndarray, parent: int | None = None) -> list[int]:
    """s_j = s_{j-1} * Q + sum_i (t_{j,i} XOR a_i) * w_i  (mod 2**64), token by token."""
    ps = hasher.page_size
    state = ROOT if parent is None else parent
    out = []
    for j in range(len(tokens) // ps):
        page_sum = 0
        for i in range(ps):
            token = int(tokens[j * ps + i]) & _MASK
            page_sum += (token ^ int(hasher.xor_salt[i])) * int(hasher.weight[i])
        state = (state * _Q + page_sum) & _MASK
        out.append(state)
    return out


@pytest.mark.parametrize("page_size", [1, 3, 16, 128])
def test_matches_reference(page_size: int) -> None:
    hasher = PageHasher(page_size)
    rng = np.random.default_rng(page_size)
    tokens = rng.integers(-3, 1 << 40, size=page_size * 20)
    assert hasher.hash_pages(tokens) == reference_hashes(hasher, tokens)
    assert hasher.hash_pages(tokens, parent=12345) == reference_hashes(hasher, tokens, 12345)


def test_incremental_equals_one_call() -> None:
    hasher = PageHasher(4)
    tokens = np.arange(4 * 11, dtype=np.int64) * 7
    whole = hasher.hash_pages(tokens)
    for split in (1, 5, 10):
        head = hasher.hash_pages(tokens[: 4 * split])
        assert head + hasher.hash_pages(tokens[4 * split :], head[-1]) == whole


def test_many_pages_grow_the_tables() -> None:
    hasher = PageHasher(2)
    tokens = np.arange(2 * 1000)
    hashes = hasher.hash_pages(tokens)
    assert len(hashes) == 1000
    assert hashes[-5:] == reference_hashes(hasher, tokens)[-5:]


def test_prefix_property() -> None:
    hasher = PageHasher(4)
    a = np.arange(16)
    b = a.copy()
    b[9] = 999  # third page differs
    ha, hb = hasher.hash_pages(a), hasher.hash_pages(b)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]  # the chain carries the difference on


def test_order_within_page_matters() -> None:
    hasher = PageHasher(4)
    assert hasher.hash_pages(np.array([1, 2, 3, 4])) != hasher.hash_pages(np.array([2, 1, 3, 4]))


def test_dtype_does_not_matter() -> None:
    hasher = PageHasher(3)
    tokens = np.arange(9)
    assert hasher.hash_pages(tokens.astype(np.int32)) == hasher.hash_pages(tokens)


def test_distinct_pages_rarely_collide() -> None:
    hasher = PageHasher(4)
    rng = np.random.default_rng(0)
    hashes = hasher.hash_pages(rng.integers(0, 50, size=4 * 5000))
    assert len(set(hashes)) == 5000


def test_rejects_partial_pages() -> None:
    with pytest.raises(ValueError, match="10 tokens are not whole pages of 4"):
        PageHasher(4).hash_pages(np.arange(10))
    assert PageHasher(4).hash_pages(np.arange(0)) == []
    with pytest.raises(ValueError, match="page_size must be positive, got 0"):
        PageHasher(0)


def test_rehash_recomputes_single_steps() -> None:
    hasher = PageHasher(3)
    tokens = np.arange(12)
    chain = hasher.hash_pages(tokens)
    assert hasher.rehash(tokens.reshape(4, 3), [None, *chain[:-1]]) == chain

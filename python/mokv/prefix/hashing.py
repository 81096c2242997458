"""Chained page hashes for prefix caching, computed for many pages at once.

Page `j` of a request (tokens `t_{j,0..P-1}`, P = page size) gets the 64-bit hash

    s_j = s_{j-1} * Q + c_j,    c_j = sum_i (t_{j,i} XOR a_i) * w_i      (all mod 2**64)

with `s_{-1}` the parent hash (`ROOT` for a request's first page, or
`salted_root(salt)` for a request with a cache salt) and fixed
per-position constants `a_i`, `w_i` (odd). `s_j` depends on every token up to
the end of page `j`, in order, so equal hashes mean equal prefixes up to hash
collisions, which the prefix index rules out by also checking the stored tokens
and parent identity before a page is reused (`index.PageIndex.match`).

The recurrence is linear, so a request's pages are hashed in a few numpy calls:
`s_j = Q**j * (s_{-1} * Q + sum_{b<=j} Q**-b * c_b)`, and the inner sum is one
running sum over tokens weighted by `Q**-b * w_i`, read at each page's end.
`Q` is odd, hence invertible mod 2**64; uint64 array arithmetic wraps mod 2**64.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

_MASK = (1 << 64) - 1
ROOT = 0x9E3779B97F4A7C15
"""Parent hash of a request's first page."""

_Q = 0xFF51AFD7ED558CCD
_Q_INV = pow(_Q, -1, 1 << 64)


def salted_root(salt: str) -> int:
    """The parent hash of the first page of a request with cache salt `salt`:
    requests with different salts start different chains."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"mokv-salt").digest()
    return ROOT ^ int.from_bytes(digest, "little")


def _powers(base: int, n: int) -> npt.NDArray[np.uint64]:
    """`[base**0, ..., base**(n-1)]` mod 2**64."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    return np.multiply.accumulate(out)


class PageHasher:
    """Hashes full pages of `page_size` tokens into chained 64-bit ints."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        rng = np.random.default_rng(0x6D6F6B76)
        self.xor_salt = rng.integers(0, 1 << 63, size=page_size, dtype=np.uint64)
        """`a_i`: makes the hash non-linear in each token."""
        self.weight = rng.integers(0, 1 << 63, size=page_size, dtype=np.uint64) | np.uint64(1)
        """`w_i`: makes the hash depend on token order within a page."""
        self._grow(8)

    def _grow(self, num_pages: int) -> None:
        """Sizes the per-token tables for `num_pages` pages per call."""
        self._q_pow = _powers(_Q, num_pages)
        self._token_xor = np.tile(self.xor_salt, num_pages)
        self._token_weight = np.outer(_powers(_Q_INV, num_pages), self.weight).ravel()

    def hash_pages(self, tokens: npt.NDArray[np.integer], parent: int | None = None) -> list[int]:
        """Chained hashes of the consecutive full pages in `tokens`.

        Args:
            tokens: `k * page_size` token ids, page-aligned.
            parent: Hash of the page before `tokens[0]`; None at a request's start.

        Returns:
            `k` hashes. Hashing pages over several calls, passing the last hash
            on as `parent`, gives the same hashes as one call.
        """
        ps = self.page_size
        n = tokens.size
        if n % ps:
            raise ValueError(f"{n} tokens are not whole pages of {ps}")
        k = n // ps
        if k == 0:
            return []
        if k > len(self._q_pow):
            self._grow(max(k, 2 * len(self._q_pow)))
        t = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1).view(np.uint64)
        weighted = np.bitwise_xor(t, self._token_xor[:n])  # one temporary, reused in place
        np.multiply(weighted, self._token_weight[:n], out=weighted)
        page_sums = np.add.accumulate(weighted, out=weighted)[ps - 1 :: ps]
        page_sums += np.uint64(((ROOT if parent is None else parent) * _Q) & _MASK)
        page_sums *= self._q_pow[:k]
        return page_sums.tolist()

    def rehash(self, pages: npt.NDArray[np.integer], parents: list[int | None]) -> list[int]:
        """Each row's hash given its parent's: one step of the recurrence per page.

        Used to audit a prefix index, whose entries are single pages, and to
        hash a decode step's newly full pages in one call.
        """
        t = np.ascontiguousarray(pages, dtype=np.int64).view(np.uint64)
        page_sums = np.bitwise_xor(t, self.xor_salt) @ self.weight  # uint64 products and sums wrap mod 2**64
        if None in parents:
            parents = [ROOT if p is None else p for p in parents]
        starts = np.array(parents, dtype=np.uint64)
        starts *= np.uint64(_Q)
        page_sums += starts
        return page_sums.tolist()

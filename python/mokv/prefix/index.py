"""The verified prefix index of one tier: committed pages by chained hash.

Every tier that serves prefix hits by the per-process chain (the device pool,
the host tier) keeps one. A committed page is indexed under its chained hash
(`hashing.PageHasher`) with what a hit must verify before its bytes are used:
its own `uid` (fresh for every commit in this process), its parent's `uid` and
hash, and its tokens. A page is reused only when its stored tokens equal the
request's and its parent is the page the request matched just before; so a
reused page's whole prefix equals the request's, and a hash collision can cost
a hit but never serve the wrong KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from .hashing import PageHasher

NO_UID = 0
"""The `uid` of "no page": the parent of a request's first page."""


class PageIndex:
    """Committed pages of one tier (device pages or host pages), by chained hash.

    For each page it keeps what a hit must verify: the hash, the page's `uid`,
    its parent's `uid` and hash, and the page's tokens.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self._by_hash: dict[int, int] = {}
        self.hash: list[int | None] = [None] * num_pages
        self.uid: list[int] = [NO_UID] * num_pages
        self.parent_uid: list[int] = [NO_UID] * num_pages
        self.parent_hash: list[int | None] = [None] * num_pages
        self.tokens: npt.NDArray[np.int64] = np.zeros((num_pages, page_size), dtype=np.int64)

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, page_hash: int) -> int | None:
        """The page committed under `page_hash`, if any."""
        return self._by_hash.get(page_hash)

    def has_any(self, hashes: Iterable[int]) -> bool:
        """Whether any of `hashes` is committed."""
        return not self._by_hash.keys().isdisjoint(hashes)

    def is_committed(self, page: int) -> bool:
        """Whether `page` is committed."""
        return self.hash[page] is not None

    def insert(
        self,
        page: int,
        page_hash: int,
        uid: int,
        parent_uid: int,
        parent_hash: int | None,
        tokens: npt.NDArray[np.integer] | None,
    ) -> None:
        """Commits `page` under `page_hash`, which must be free in this index.
        With `tokens` None the caller stores the page's row of `self.tokens`
        itself (several pages in one numpy call) before the next lookup."""
        if page_hash in self._by_hash:
            raise ValueError(f"hash {page_hash:#x} is already committed to page {self._by_hash[page_hash]}")
        if self.hash[page] is not None:
            raise ValueError(f"page {page} is already committed")
        self._by_hash[page_hash] = page
        self.hash[page] = page_hash
        self.uid[page] = uid
        self.parent_uid[page] = parent_uid
        self.parent_hash[page] = parent_hash
        if tokens is not None:
            self.tokens[page] = tokens

    def insert_many(
        self,
        pages: list[int],
        hashes: list[int],
        first_uid: int,
        parent_uids: Sequence[int],
        parent_hashes: Sequence[int | None],
        tokens: npt.NDArray[np.integer],
    ) -> bool:
        """Commits several pages at once: page k gets `hashes[k]`, uid
        `first_uid + k` and, as parent, `parent_uids[k]` / `parent_hashes[k]`;
        `tokens` has one row per page. Returns False, having written nothing,
        when a hash repeats or is committed already.

        Raises:
            ValueError: A page repeats or is committed already.
        """
        own_hash, by_hash = self.hash, self._by_hash
        if len(set(pages)) != len(pages) or [own_hash[page] for page in pages].count(None) != len(pages):
            raise ValueError(f"pages {pages} repeat or are already committed")
        if not by_hash.keys().isdisjoint(hashes):
            return False
        size = len(by_hash)
        by_hash.update(zip(hashes, pages, strict=True))
        if len(by_hash) != size + len(hashes):  # a hash repeats among `hashes`
            for page_hash in hashes:
                by_hash.pop(page_hash, None)
            return False
        uid, parent_uid, parent_hash = self.uid, self.parent_uid, self.parent_hash
        uids = range(first_uid, first_uid + len(pages))
        for page, page_hash, page_uid, parent, parents_hash in zip(
            pages, hashes, uids, parent_uids, parent_hashes, strict=True
        ):
            own_hash[page] = page_hash
            uid[page] = page_uid
            parent_uid[page] = parent
            parent_hash[page] = parents_hash
        self.tokens[np.array(pages, np.intp)] = tokens
        return True

    def copy_entry(self, page: int, source: PageIndex, source_page: int) -> None:
        """Commits `page` with the identity of `source`'s `source_page` (a tier move)."""
        page_hash = source.hash[source_page]
        assert page_hash is not None
        self.insert(
            page,
            page_hash,
            source.uid[source_page],
            source.parent_uid[source_page],
            source.parent_hash[source_page],
            source.tokens[source_page],
        )

    def remove(self, page: int) -> None:
        """Uncommits `page`."""
        self.remove_many([page])

    def remove_many(self, pages: list[int]) -> None:
        """Uncommits each of `pages` (committed ones, each once)."""
        by_hash, own_hash, uid = self._by_hash, self.hash, self.uid
        for page in pages:
            del by_hash[own_hash[page]]
            own_hash[page] = None
            uid[page] = NO_UID

    def match(self, hashes: Sequence[int], parent_uid: int, tokens: npt.NDArray[np.integer]) -> list[int]:
        """The longest run of pages continuing a chain, verified.

        Args:
            hashes: Chained hashes of the request's next pages.
            parent_uid: `uid` of the page before them (`NO_UID` at the start).
            tokens: Those pages' tokens, `[len(hashes), page_size]`.

        Returns:
            Pages for a prefix of `hashes` whose parents chain up to
            `parent_uid` and whose stored tokens equal `tokens`.
        """
        pages: list[int] = []
        page_of, parent_uid_of, uid_of = self._by_hash.get, self.parent_uid, self.uid
        for page_hash in hashes:
            page = page_of(page_hash)
            if page is None or parent_uid_of[page] != parent_uid:
                break
            pages.append(page)
            parent_uid = uid_of[page]
        if pages:  # one bytes comparison for the whole run; rows only on a mismatch
            stored, wanted = self.tokens[pages], np.asarray(tokens[: len(pages)], np.int64)
            if stored.tobytes() != wanted.tobytes():
                same = (stored == wanted).all(axis=1)
                del pages[int(np.argmin(same)) :]
        return pages

    def committed_pages(self) -> list[int]:
        """Every committed page."""
        return list(self._by_hash.values())

    def check(self, hasher: PageHasher) -> None:
        """Asserts every committed hash names a page holding exactly those tokens."""
        for page_hash, page in self._by_hash.items():
            if self.hash[page] != page_hash:
                raise AssertionError(f"hash {page_hash:#x} maps to page {page} committed as {self.hash[page]}")
        pages = list(self._by_hash.values())
        expected = hasher.rehash(self.tokens[pages], [self.parent_hash[p] for p in pages])
        for page, page_hash in zip(pages, expected, strict=True):
            if page_hash != self.hash[page]:
                raise AssertionError(f"page {page}'s tokens hash to {page_hash:#x}, not {self.hash[page]:#x}")
        if len(self.hash) - self.hash.count(None) != len(self._by_hash):
            raise AssertionError("some pages carry hashes the index does not map to them")

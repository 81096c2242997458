"""One replica's device pages: who owns each page, and which hold cached prefixes.

At any moment a page is in exactly one of three states:

* free: ref count 0, in the free queue, not in the prefix cache;
* cached: ref count 0, in the free queue *and* in the prefix cache: its KV is
  still valid and a request with the same prefix may take it back (a hit)
  until the queue hands it out again (an eviction);
* used: ref count N > 0, held by N requests, out of the free queue (and in the
  prefix cache once it is full and committed).

The free queue is an `OrderedDict` used as an LRU list: pages are handed out
from the front and returned to the back, and a hit removes a cached page from
the middle, all in O(1). Managers free a request's pages tail first, so a
shared prefix's head outlives its tails.

A cached page is only reused when its stored tokens equal the request's and
its parent (the page before it when it was committed) is the page the request
matched just before; every committed page gets a fresh `uid` for that check
(`mokv.prefix.PageIndex`). Together these make a reused page's whole prefix
equal to the request's, so a hash collision can cost a hit but never serve the
wrong KV.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np
import numpy.typing as npt

from ..prefix import NO_UID, PageHasher, PageIndex


class InsufficientBlocksError(RuntimeError):
    """There are not enough free pages for an allocation; nothing was changed
    (MAX's name for the error)."""


@dataclass(eq=False, slots=True)
class Chain:
    """A run of freshly computed pages to commit after a parent (`PagePool.commit_chains`)."""

    pages: list[int]
    """The pages, each following the one before it."""
    hashes: list[int]
    """Their chained hashes."""
    parent_uid: int
    """`uid` of the page before the first (`NO_UID` at a request's start, a
    negative uid for a salted request's root)."""
    parent_hash: int | None
    """Hash of the page before the first (None: the hasher's root)."""


class PagePool:
    """Pages `0 .. num_pages-1` of one replica (the null page is not one of them).

    Args:
        num_pages: Pages in the pool.
        page_size: Tokens per page.
        on_evict: Called with a cached page's id just before the page is
            handed out again, while its KV is still intact (the host tier
            copies it out).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.ref_count: list[int] = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.index = PageIndex(num_pages, page_size)
        self.on_evict = on_evict
        self._last_uid = NO_UID

    @property
    def num_free(self) -> int:
        """Pages no request holds (free or cached)."""
        return len(self._free)

    def free_order(self) -> list[int]:
        """The free queue, next page to hand out first."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hands out `n` pages from the front of the free queue, evicting cached ones."""
        if n > len(self._free):
            raise ValueError(f"cannot hand out {n} pages, {len(self._free)} are free")
        free = self._free
        pages = list(islice(free, n))
        for page in pages:
            del free[page]
        committed = self.index.hash
        evicted = [page for page in pages if committed[page] is not None]
        if evicted:
            if self.on_evict is not None:
                for page in evicted:
                    self.on_evict(page)
            self.index.remove_many(evicted)
        ref_count = self.ref_count
        for page in pages:
            ref_count[page] = 1
        return pages

    def touch(self, pages: list[int]) -> None:
        """Adds a holder to each of `pages`, taking cached ones off the free queue."""
        ref_count, free = self.ref_count, self._free
        for page in pages:
            if not ref_count[page]:
                del free[page]
            ref_count[page] += 1

    def refresh(self, pages: Iterable[int]) -> None:
        """Moves each unheld page to the back of the free queue, in order: a
        use that took no hold (MAX's failed allocation touches its hits)."""
        for page in pages:
            if self.ref_count[page] == 0:
                self._free.move_to_end(page)

    def free(self, pages: list[int]) -> None:
        """Drops one holder from each of `pages` (distinct); unheld ones go to
        the back of the queue, in order. Changes nothing if one is unheld."""
        ref_count, free = self.ref_count, self._free
        if pages and min(map(ref_count.__getitem__, pages)) < 1:
            unheld = next(page for page in pages if ref_count[page] < 1)
            raise ValueError(f"page {unheld} freed more often than it was held")
        for page in pages:
            count = ref_count[page] - 1
            ref_count[page] = count
            if not count:
                free[page] = None

    def commit(
        self,
        page: int,
        page_hash: int,
        parent_uid: int,
        parent_hash: int | None,
        tokens: npt.NDArray[np.integer] | None,
        uid: int = NO_UID,
    ) -> int:
        """Puts a full page in the prefix cache and returns its `uid`: a new
        one for a freshly computed (or freshly loaded) page, or `uid` for a
        page restored from a tier that kept the identity this pool gave it
        (`tokens` as in `PageIndex.insert`)."""
        if uid == NO_UID:
            self._last_uid += 1
            uid = self._last_uid
        self.index.insert(page, page_hash, uid, parent_uid, parent_hash, tokens)
        return uid

    def commit_chains(self, chains: list[Chain], tokens: npt.NDArray[np.integer]) -> list[int] | None:
        """`commit` for runs of freshly computed pages in one call; `tokens`
        has one row per page, chains in order. Returns each chain's last uid
        (`parent_uid` for an empty one), or None, having changed nothing, if a
        hash repeats or is cached already."""
        pages: list[int] = []
        hashes: list[int] = []
        parent_uids: list[int] = []
        parent_hashes: list[int | None] = []
        last_uids = []
        uid = self._last_uid
        for chain in chains:
            n = len(chain.pages)
            if n:
                pages += chain.pages
                hashes += chain.hashes
                parent_uids.append(chain.parent_uid)
                parent_hashes.append(chain.parent_hash)
                if n > 1:  # each later page's parent is the one before it
                    parent_uids += range(uid + 1, uid + n)
                    parent_hashes += chain.hashes[:-1]
                uid += n
            last_uids.append(uid if n else chain.parent_uid)
        if self.commit_pages(pages, hashes, parent_uids, parent_hashes, tokens) is None:
            return None
        return last_uids

    def commit_pages(
        self,
        pages: list[int],
        hashes: list[int],
        parent_uids: Sequence[int],
        parent_hashes: Sequence[int | None],
        tokens: npt.NDArray[np.integer],
    ) -> range | None:
        """`commit` for freshly computed pages in one call: page k gets
        `hashes[k]`, its parent's uid and hash, and row k of `tokens`. Returns
        their new uids, or None, having changed nothing, if a hash repeats or
        is cached already."""
        first_uid = self._last_uid + 1
        if not self.index.insert_many(pages, hashes, first_uid, parent_uids, parent_hashes, tokens):
            return None
        self._last_uid += len(pages)
        return range(first_uid, self._last_uid + 1)

    def uncommit(self, page: int) -> None:
        """Takes a page out of the prefix cache (it keeps its holders)."""
        self.index.remove(page)

    def reset_prefix_cache(self) -> int:
        """Uncommits every cached page no request holds; returns how many."""
        dropped = [p for p in self.index.committed_pages() if self.ref_count[p] == 0]
        for page in dropped:
            self.index.remove(page)
        return len(dropped)

    def check_invariants(self, holders: Counter[int], hasher: PageHasher) -> None:
        """Asserts the pool agrees with `holders` (page -> requests holding it)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is in the free queue twice")
        used = {p for p, n in holders.items() if n}
        if len(free) + len(used) != self.num_pages or free & used:
            raise AssertionError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_pages}); "
                f"both free and used: {sorted(free & used)}"
            )
        for page, count in holders.items():
            if self.ref_count[page] != count:
                raise AssertionError(f"page {page} has ref count {self.ref_count[page]} but {count} holders")
        if self.ref_count.count(0) != self.num_pages - len(used):
            raise AssertionError("a page nobody holds has a nonzero ref count")
        self.index.check(hasher)

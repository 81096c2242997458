"""What a replica tracks for each claimed request, from `claim` to `release`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..context import CacheContext
from ..prefix import NO_UID
from ..tiers import PageToSave


@dataclass(eq=False, slots=True)
class RequestState:
    """One claimed request on its replica: its pages, its prefix chain and the
    two thresholds the manager's fast paths compare against."""

    row: int
    """Row of the replica's page table holding the request's page ids."""
    num_pages: int = 0
    """Pages the request holds (a dummy counts its one null page)."""
    hashes: list[int] = field(default_factory=list)
    """Chained hash of each full page hashed so far (never the last token's page)."""
    num_committed: int = 0
    """Leading pages already offered to the prefix cache (or taken from it)."""
    last_uid: int = NO_UID
    """uid of page `num_committed - 1`: the parent of the next page to commit."""
    chain_broken: bool = False
    """A page could not be committed, so later pages have no verifiable parent."""
    is_dummy: bool = False
    """A padding request (`alloc_dummy`): it holds only the null page."""
    keys: list[bytes] = field(default_factory=list)
    """Cross-process chained key of each hashed page (only when a tier needs them)."""
    root_key: bytes = b""
    """The key before the request's first page (it commits to the cache salt)."""
    root_hash: int | None = None
    """Parent hash of the request's first page: None (the hasher's root) unless salted."""
    source: object = None
    """The context object the caller last passed for the request (identity check)."""
    context: CacheContext | None = None
    """`source` adapted: the tokens a second context object must agree with."""
    due_at: int = 1
    """The `processed_length` from which `step` looks at the request: its next
    page to commit is full, or the context ran past its pages (so `step`
    scans a batch with one comparison per request)."""
    capacity: int = 0
    """Tokens the request's own pages hold: 0 for a dummy, whose null page
    holds none (so the manager's decode `alloc` accepts a request with one
    comparison, and never a dummy)."""

    def update_thresholds(self, page_size: int, prefix_caching: bool) -> None:
        """Recomputes `due_at` and `capacity` from the request's pages and committed pages."""
        held_tokens = self.num_pages * page_size
        self.capacity = 0 if self.is_dummy else held_tokens
        next_full = (self.num_committed + 1) * page_size
        self.due_at = next_full if prefix_caching and next_full <= held_tokens else held_tokens + 1

    def page_to_save(self, i: int, page: int, tokens: npt.NDArray[np.int64]) -> PageToSave:
        """The request's page `i` (device page `page`, holding `tokens`) with its
        cross-process identity, for a write-through tier."""
        parent_key = self.keys[i - 1] if i else self.root_key
        return PageToSave(page, self.keys[i], parent_key, tokens)


BatchEntry = tuple[CacheContext, RequestState]
"""A batch entry resolved: its context (adapted) and its request's state."""

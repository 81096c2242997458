"""A request's chain (hashes, keys, salted root) and its verified cached pages
on the device and on each tier below it.

Chains: on the device and host tiers a hit's parent is checked by `uid`
(unique per committed page in this process); the disk and remote tiers are
shared between processes, so they check a page's cryptographic chained key
(`mokv.tiers.keys`), its parent's key and its tokens instead.

Cache salt: a request's salt starts its chain at a root of its own on every
tier: its first page's parent hash (`mokv.prefix.salted_root`), its first
page's parent uid (a negative uid per salt, where unsalted requests have
`NO_UID`) and its root key. Requests with different salts therefore never
share a page, even when their hashes collide: the parent uid check (device,
host) and the parent key check (disk, remote) tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..context import CacheContext
from ..prefix import NO_UID, PageHasher, PageIndex, salted_root
from ..tiers import PrefixQuery, Tier
from ..tiers.keys import PageKeyer
from .request_state import RequestState


@dataclass(eq=False, slots=True)
class PrefixHits:
    """What `alloc` found cached for a request's next pages."""

    device: list[int]
    """Device pages, in order."""
    tiers: list[tuple[Tier, Sequence[object]]]
    """Then each tier's hits, continuing the chain, in lookup order."""
    tokens: npt.NDArray[np.int64]
    """Tokens of every looked-up page, `[pages, page_size]`."""

    @property
    def num_tier_hits(self) -> int:
        return sum(len(hits) for _, hits in self.tiers)


NO_HITS = PrefixHits([], [], np.zeros((0, 0), np.int64))


class PrefixLookup:
    """Extends requests' chains and finds their verified cached pages.

    Args:
        page_size: Tokens per page.
        hasher: The manager's page hasher.
        keyer: Keys of the cross-process chain (None when no tier needs them).
        index: The replica's device prefix index.
        tiers: The replica's tiers, in lookup order.
    """

    def __init__(
        self, page_size: int, hasher: PageHasher, keyer: PageKeyer | None, index: PageIndex, tiers: Sequence[Tier]
    ) -> None:
        self.page_size = page_size
        self.hasher = hasher
        self.keyer = keyer
        self.index = index
        self.tiers = list(tiers)
        self._salt_uids: dict[str, int] = {}

    def hash_new_pages(self, state: RequestState, ctx: CacheContext) -> None:
        """Extends `state.hashes` (and `state.keys`) to every full page before the last token."""
        ps = self.page_size
        done = len(state.hashes)
        hashable = (ctx.current_length - 1) // ps
        if hashable > done:
            if not done:
                self._start_chain(state, ctx.cache_salt)
            parent = state.hashes[-1] if done else state.root_hash
            tokens = ctx.tokens[done * ps : hashable * ps]
            state.hashes.extend(self.hasher.hash_pages(tokens, parent))
            if self.keyer is not None:
                parent_key = state.keys[-1] if done else state.root_key
                state.keys.extend(self.keyer.chain(tokens.reshape(-1, ps), parent_key))

    def _start_chain(self, state: RequestState, salt: str | None) -> None:
        """Roots the request's chain on every tier in its cache salt (see the module docstring)."""
        if salt is not None:
            state.root_hash = salted_root(salt)
            if state.num_committed == 0:
                state.last_uid = self._salt_uids.setdefault(salt, -1 - len(self._salt_uids))
        if self.keyer is not None:
            state.root_key = self.keyer.root(salt)

    def device_hits(self, ctx: CacheContext) -> list[int]:
        """The cached device pages `find` would reuse for `ctx` as a new request
        now, read without changing anything (no request state, no tier lookup):
        the verified run of committed pages continuing the chain of its full
        pages before its last token, rooted in its cache salt. Empty for a
        context that processed tokens already, and for a salt no page was ever
        cached under here."""
        ps = self.page_size
        hashable = (ctx.current_length - 1) // ps
        if hashable < 1 or ctx.processed_length:
            return []
        parent_uid: int | None = NO_UID
        root_hash = None
        if ctx.cache_salt is not None:
            parent_uid = self._salt_uids.get(ctx.cache_salt)
            root_hash = salted_root(ctx.cache_salt)
        if parent_uid is None:
            return []
        tokens = ctx.tokens[: hashable * ps]
        return self.index.match(self.hasher.hash_pages(tokens, root_hash), parent_uid, tokens.reshape(hashable, ps))

    def find(self, state: RequestState, ctx: CacheContext) -> PrefixHits:
        """Verified cached pages continuing the request: on the device, then on each tier.

        Only a request whose cached state ends exactly at its committed pages
        (a new request, in practice) can take hits.
        """
        ps = self.page_size
        start = state.num_committed
        if state.chain_broken or state.num_pages != start or ctx.processed_length != start * ps:
            return NO_HITS
        self.hash_new_pages(state, ctx)
        wanted = state.hashes[start:]
        if not wanted:
            return NO_HITS
        tokens = ctx.tokens[start * ps : (start + len(wanted)) * ps].reshape(len(wanted), ps)
        index = self.index
        device_hits = index.match(wanted, state.last_uid, tokens)
        hits = PrefixHits(device_hits, [], tokens)
        n = len(device_hits)
        if not self.tiers or n == len(wanted):
            return hits
        # A hash the device still maps (to a page that failed verification)
        # cannot be committed again, so tier hits stop there.
        end = next((i for i in range(n, len(wanted)) if index.get(wanted[i]) is not None), len(wanted))
        parent_uid: int | None = index.uid[device_hits[-1]] if device_hits else state.last_uid
        for tier in self.tiers:
            if n == end:
                break
            if tier.needs_keys:
                first = start + n
                parent_key = state.keys[first - 1] if first else state.root_key
                keys = state.keys[first : start + end]
            else:
                parent_key, keys = b"", ()
            query = PrefixQuery(ctx.request_id, wanted[n:end], tokens[n:end], parent_uid, keys, parent_key)
            found = tier.lookup(query)
            if found:
                hits.tiers.append((tier, found))
                n += len(found)
                parent_uid = None  # the chain now continues through pages not yet on the device
        return hits

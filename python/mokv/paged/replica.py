"""One data-parallel replica's policy: which pages its requests hold, and when
cached pages are reused, committed and given back.

A replica owns a page pool (page ids are the same in every cache of a
`MultiKVCacheParams`), a page table (one null-padded row of page ids per
request) and the tiers below its device pool (`mokv.tiers`: host memory,
disk, remote store), which it talks to only through the `Tier` interface. The
manager routes each call here after validating it; nothing here knows about
other replicas.

Prefix caching, in the life of one request:

* `alloc` looks up the longest verified run of cached pages continuing the
  request's committed pages (`prefix_lookup`): on the device first, then on
  each tier in order, each continuing where the previous one stopped. It
  takes the device hits, moves the context's window past all hits' tokens,
  and hands out fresh pages for the rest, loading the tiers' hits into the
  first of them.
* `commit` (from the manager's `step`) offers each newly full page to the
  prefix cache (`commit.CommitEngine`); a page whose verified twin is already
  cached is swapped for the twin (dedup) and freed. Newly cached pages are
  saved to the write-through tiers (disk, remote); the host tier takes pages
  as the pool evicts them.
* `release` frees the request's pages tail first, so a shared prefix's head
  outlives its tails in the LRU free queue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import replace

from max.driver import Device

from ..buffer import KVCacheBuffer
from ..context import CacheContext
from ..metrics import KVCacheMetrics
from ..prefix import PageHasher
from ..tiers import PageToSave, SavePoint, Tier
from ..tiers.config import TierFactory
from .commit import CommitEngine
from .page_pool import InsufficientBlocksError, PagePool
from .page_table import PageTable
from .prefix_lookup import NO_HITS, PrefixHits, PrefixLookup
from .request_state import BatchEntry, RequestState
from .runtime_inputs import InputStaging


class Replica:
    """One replica's memory and request policy.

    Args:
        index: The replica's index (for error messages).
        total_num_pages: Device pages for requests (the null page is extra).
        tiers: Builds the replica's tiers (`mokv.tiers.config`).
        page_size: Tokens per page.
        prefix_caching: Whether full pages are committed and reused.
        max_batch_size: Initial rows of the page table.
        devices: The replica's TP devices.
        buffers: One `KVCacheBuffer` per leaf cache, by leaf name.
        hasher: The manager's page hasher.
    """

    def __init__(
        self,
        index: int,
        total_num_pages: int,
        tiers: TierFactory,
        page_size: int,
        prefix_caching: bool,
        max_batch_size: int,
        devices: Sequence[Device],
        buffers: dict[str, KVCacheBuffer],
        hasher: PageHasher,
    ) -> None:
        self.index = index
        self.total_num_pages = total_num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.devices = list(devices)
        self.buffers = buffers
        self.hasher = hasher
        self.metrics = KVCacheMetrics()
        self.cache_tokens_by_salt: Counter[str | None] = Counter()
        """Tokens served from cache (any tier), per cache salt."""
        self.requests: dict[Hashable, RequestState] = {}
        self.pool = PagePool(total_num_pages, page_size)
        memory = [unit for buffer in buffers.values() for unit in buffer.to_memory()]
        self.tiers = tiers(memory, self.pool.index)
        self.keyer = self.tiers.keyer
        self.host = self.tiers.host
        if self.tiers.on_evict:
            self.pool.on_evict = self._offload
        self.table = PageTable(null_page=total_num_pages, initial_rows=max_batch_size)
        self.staging = InputStaging(null_page=total_num_pages)
        self.lookup = PrefixLookup(page_size, hasher, self.keyer, self.pool.index, self.tiers)
        self.committer = CommitEngine(
            page_size,
            prefix_caching,
            hasher,
            self.keyer,
            self.pool,
            self.table,
            self.lookup,
            bool(self.tiers.on_commit),
            self._save_through,
        )

    # ------------------------------------------------------------ tier seam

    def _offload(self, page: int) -> None:
        """The pool is about to hand out cached `page`: victim tiers copy it first."""
        self.tiers.offload(page, self.metrics)

    def _save_through(self, items: list[PageToSave], source: Tier | None) -> None:
        """Newly cached pages go to every write-through tier but `source`."""
        self.tiers.save_through(items, self.metrics, source)

    def wait_for_loads(self) -> None:
        """Returns once every tier's loads into device pages have landed."""
        self.tiers.wait_for_loads()

    # ---------------------------------------------------------------- lifecycle

    def claim(self, request_id: Hashable, *, dummy: bool = False) -> None:
        """Gives `request_id` a table row; a dummy holds only the null page."""
        state = RequestState(self.table.add_row())
        if dummy:
            state.num_pages = 1  # table rows start out null
            state.is_dummy = True
        state.update_thresholds(self.page_size, self.prefix_caching)
        self.requests[request_id] = state

    def pages_of(self, request_id: Hashable) -> list[int]:
        """The request's page ids, in token order."""
        state = self.requests[request_id]
        return self.table.read(state.row, 0, state.num_pages)

    def alloc(self, ctx: CacheContext, state: RequestState, num_steps: int) -> None:
        """Gives the request pages for its next `num_steps` steps (see the module
        docstring).

        On `InsufficientBlocksError` only one thing has changed, as in MAX's
        manager: the cached device pages the request matched count as used,
        so the unheld ones move to the most-recently-used end of the free
        queue (tail first, like a release), and a retry finds them again.
        """
        ps = self.page_size
        seq_len = ctx.current_length + num_steps - 1
        num_new = -(-seq_len // ps) - state.num_pages
        active = ctx.active_length
        if active == 1 and (num_new <= 0 or (num_new == 1 and self.pool.num_free)):
            # Decode: no prefix lookup (the last token is never served from
            # cache), at most one new page and one to give.
            if num_new == 1:
                (page,) = self.pool.allocate(1)
                self.table.set(state.row, state.num_pages, page)
                state.num_pages += 1
                state.update_thresholds(ps, self.prefix_caching)
            self.metrics.input_tokens += 1
            return
        looks_up = self.prefix_caching and active > 1
        first_admission = ctx.processed_length == 0
        hits = self.lookup.find(state, ctx) if looks_up else NO_HITS
        hit_tokens = 0
        try:
            if seq_len > self.total_num_pages * ps:
                raise InsufficientBlocksError(
                    f"request {ctx.request_id!r} needs {seq_len} tokens of KV (current_length "
                    f"{ctx.current_length}, num_steps={num_steps}) but a replica holds only "
                    f"{self.total_num_pages * ps} ({self.total_num_pages} pages of {ps} tokens)"
                )
            if hits.device or num_new > 0:
                new_pages = max(0, num_new - len(hits.device))
                hit_tokens = self._extend(state, ctx, new_pages, hits)
        except InsufficientBlocksError:
            self.pool.refresh(reversed(hits.device))
            raise
        if looks_up and first_admission:  # as MAX's manager records it
            ctx.cached_prefix_length = hit_tokens
        self.metrics.input_tokens += ctx.active_length

    def _extend(self, state: RequestState, ctx: CacheContext, num_new: int, hits: PrefixHits) -> int:
        """Appends cached `hits.device`, then `num_new` fresh pages (the first
        of them loaded with the tiers' hits), to the request. Returns the
        tokens served from cache."""
        pool = self.pool
        device_hits = hits.device
        ref_count = pool.ref_count
        free_after_hits = pool.num_free - list(map(ref_count.__getitem__, device_hits)).count(0)
        if num_new > free_after_hits:
            in_use = self.total_num_pages - pool.num_free
            raise InsufficientBlocksError(
                f"request {ctx.request_id!r} needs {num_new} new pages on replica "
                f"{self.index} but only {free_after_hits} are free "
                f"({in_use}/{self.total_num_pages} in use)"
            )
        pool.touch(device_hits)
        for tier, tier_hits in hits.tiers:
            tier.reserve(tier_hits)
        new_pages = pool.allocate(num_new)
        last_uid = pool.index.uid[device_hits[-1]] if device_hits else state.last_uid
        if hits.tiers:
            last_uid = self._load_tier_hits(state, ctx, hits, new_pages, last_uid)
        self.table.write(state.row, state.num_pages, device_hits + new_pages)
        state.num_pages += len(device_hits) + len(new_pages)
        num_hits = len(device_hits) + hits.num_tier_hits
        state.num_committed += num_hits
        state.update_thresholds(self.page_size, self.prefix_caching)
        if not num_hits:
            return 0
        state.last_uid = last_uid
        cached_tokens = num_hits * self.page_size
        ctx.skip_processing(cached_tokens)
        self.metrics.cache_tokens += cached_tokens
        self.cache_tokens_by_salt[ctx.cache_salt] += cached_tokens
        return cached_tokens

    def _load_tier_hits(
        self, state: RequestState, ctx: CacheContext, hits: PrefixHits, pages: list[int], last_uid: int
    ) -> int:
        """Loads each tier's hits into the first fresh `pages` and commits
        them to the device prefix cache; returns the last one's uid."""
        i = state.num_committed + len(hits.device)  # the request's index of the next page
        row = len(hits.device)  # its row of hits.tokens
        cursor = 0
        for tier, tier_hits in hits.tiers:
            targets = pages[cursor : cursor + len(tier_hits)]
            uids = tier.load(ctx.request_id, tier_hits, targets)
            saves = []
            for page, uid in zip(targets, uids, strict=True):
                parent_hash = state.hashes[i - 1] if i else state.root_hash
                tokens = hits.tokens[row]
                last_uid = self.pool.commit(page, state.hashes[i], last_uid, parent_hash, tokens, uid=uid)
                if self.keyer is not None:
                    saves.append(state.page_to_save(i, page, tokens))
                i += 1
                row += 1
            cursor += len(tier_hits)
            if tier.saves_on is SavePoint.COMMIT and saves:
                tier.sync()  # the loaded bytes are what the other tiers copy
                self._save_through(saves, tier)
        self.metrics.h2d_blocks_copied += cursor
        return last_uid

    def commit(self, due: Sequence[BatchEntry]) -> None:
        """Offers each due request's newly full pages to the prefix cache (`commit.CommitEngine`)."""
        self.committer.commit(due)

    def release(self, request_id: Hashable) -> None:
        """Returns a request's pages; cached ones stay reusable until evicted."""
        state = self.requests.pop(request_id)
        for tier in self.tiers:
            tier.request_complete(request_id)
        if not state.is_dummy:
            pages = self.table.read(state.row, 0, state.num_pages)
            if self.prefix_caching:
                pages.reverse()
            self.pool.free(pages)
        self.table.drop_row(state.row, state.num_pages)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page no request holds, and every tier's pages."""
        self.pool.reset_prefix_cache()
        for tier in self.tiers:
            tier.reset()

    def shutdown(self) -> None:
        """Lets every tier finish its copies and release its threads, files and connections."""
        for tier in self.tiers:
            tier.shutdown()

    def check_invariants(self) -> None:
        """Asserts the pool, the requests' table rows and the host tier agree."""
        holders: Counter[int] = Counter()
        for request_id, state in self.requests.items():
            expected = replace(state)
            expected.update_thresholds(self.page_size, self.prefix_caching)
            if (state.due_at, state.capacity) != (expected.due_at, expected.capacity):
                raise AssertionError(
                    f"request {request_id!r} is due at {state.due_at} with capacity {state.capacity}, "
                    f"not {expected.due_at} and {expected.capacity}"
                )
            if not state.is_dummy:
                holders.update(self.table.read(state.row, 0, state.num_pages))
        self.pool.check_invariants(holders, self.hasher)
        if self.host is not None:
            self.host.check_invariants(self.hasher)

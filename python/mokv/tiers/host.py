"""The host-memory tier: a victim cache under one replica's device prefix cache.

When the device pool evicts a cached page, its bytes (in every memory unit)
are copied (d2h) to a host page, which keeps the page's identity (hash, uid,
parent, tokens). A later prefix lookup that misses on the device continues on
the host tier; each host hit is copied back (h2d) into a fresh device page and
keeps its uid, so the per-process chain check stays exact. Host pages are
evicted least-recently-used first. The tier is inclusive: a restored page
stays on the host, so evicting the device page again costs no second copy.

Copies go through MAX driver `Buffer` views of the raw pages (`to_memory()`),
so they work for any dtype and device. Host pages beside an accelerator are
the driver's staging memory for it (`host_pages`: page-locked where the
backend offers it, so copies can be DMA transfers), beside a CPU cache plain
host memory. A `Buffer` copy is only enqueued when the call returns (on the
CPU too), so every offload and restore waits for its copies: the evicted
page is about to be overwritten, and the restored one read by the next graph.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from max.driver import CPU, Buffer, Device, Usage
from max.dtype import DType

from ..buffer import KVCacheMemory
from ..prefix import PageHasher, PageIndex
from .base import PageToSave, PrefixQuery, SavePoint, TierMetrics, TierUsage


def host_pages(num_pages: int, bytes_per_page: int, device: Device) -> Buffer:
    """Host memory for `num_pages` pages copied to and from `device`: the
    driver's staging memory for an accelerator (`Usage.STAGING`, page-locked
    where the backend offers it), plain host memory for a CPU device."""
    shape = [num_pages, bytes_per_page]
    if device.is_host:
        pages = Buffer.zeros(shape, DType.uint8, device=CPU())
        CPU().synchronize()  # the zero fill is asynchronous (`validation.allocate`)
        return pages
    return Buffer(DType.uint8, shape, device=device, usage=Usage.STAGING)


class HostTier:
    """Host copies of evicted cached pages of one replica (a `Tier`).

    Args:
        num_pages: Host pages.
        page_size: Tokens per page.
        device_memory: The replica's device pages, as `KVCacheBuffer.to_memory()`.
        device_index: The replica's device prefix index (identity of evicted pages).
    """

    name = "host"
    saves_on = SavePoint.EVICT
    needs_keys = False

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device_memory: list[KVCacheMemory],
        device_index: PageIndex,
    ) -> None:
        self.num_pages = num_pages
        self.index = PageIndex(num_pages, page_size)
        self.metrics = TierMetrics()
        self._device_memory = device_memory
        self._device_index = device_index
        self._page_bytes = sum(unit.bytes_per_page for unit in device_memory)
        self._pages = [host_pages(num_pages, unit.bytes_per_page, unit.buffer.device) for unit in device_memory]
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Occupied, unpinned pages; least recently used first."""
        self._empty = list(range(num_pages - 1, -1, -1))

    @property
    def num_used(self) -> int:
        """Host pages holding a cached page."""
        return self.num_pages - len(self._empty)

    def usage(self) -> TierUsage:
        page = self._page_bytes
        return TierUsage(self.num_used, self.num_pages, self.num_used * page, self.num_pages * page)

    def _take_page(self) -> int | None:
        if self._empty:
            return self._empty.pop()
        if not self._lru:
            return None
        page, _ = self._lru.popitem(last=False)
        self.index.remove(page)
        return page

    # ------------------------------------------------------------------- saves

    def save(self, pages: Sequence[PageToSave]) -> int:
        """Copies evicted cached device pages to the host; returns how many it copied."""
        started = time.perf_counter()
        copied = sum(self._offload(item.page) for item in pages)
        self.metrics.save_seconds += time.perf_counter() - started
        return copied

    def _offload(self, device_page: int) -> bool:
        """Nothing is copied when the host already holds this very page (same
        uid) or when every host page is pinned by a restore in progress."""
        page_hash = self._device_index.hash[device_page]
        assert page_hash is not None
        page = self.index.get(page_hash)
        if page is not None:
            if page not in self._lru:
                return False
            if self.index.uid[page] == self._device_index.uid[device_page]:
                self._lru.move_to_end(page)
                return False
            # A different page under the same hash: the newer one replaces it.
            del self._lru[page]
            self.index.remove(page)
        else:
            page = self._take_page()
            if page is None:
                return False
        for unit, host in zip(self._device_memory, self._pages, strict=True):
            host[page, :].inplace_copy_from(unit.buffer[device_page, :])
        self._wait_for_copies()
        self.index.copy_entry(page, self._device_index, device_page)
        self._lru[page] = None
        self.metrics.saved_pages += 1
        self.metrics.saved_bytes += self._page_bytes
        return True

    # ------------------------------------------------------------------- loads

    def lookup(self, query: PrefixQuery) -> list[int]:
        """Host pages continuing the query's uid chain with its tokens."""
        if query.parent_uid is None:
            return []
        self.metrics.lookups += 1
        return self.index.match(query.hashes, query.parent_uid, query.tokens)

    def reserve(self, hits: Sequence[int]) -> None:
        """Pins host pages `hits` so the allocation before their restore cannot evict them."""
        for page in hits:
            del self._lru[page]

    def load(self, request_id: Hashable, hits: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Copies pinned host pages into device `pages` and unpins them; each
        device page keeps its host page's uid."""
        started = time.perf_counter()
        for page, device_page in zip(hits, pages, strict=True):
            for unit, host in zip(self._device_memory, self._pages, strict=True):
                for device_pages in unit.copies:
                    device_pages[device_page, :].inplace_copy_from(host[page, :])
        self._wait_for_copies()
        for page in hits:
            self._lru[page] = None
        self.metrics.hit_pages += len(hits)
        self.metrics.hit_bytes += len(hits) * self._page_bytes
        self.metrics.load_seconds += time.perf_counter() - started
        return [self.index.uid[page] for page in hits]

    def _wait_for_copies(self) -> None:
        for unit in self._device_memory:
            for device_pages in unit.copies:
                device_pages.device.synchronize()
        for host in self._pages:
            host.device.synchronize()

    # Host copies are waited for as they are made, so there is never anything
    # in flight to wait for.
    def sync(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def request_complete(self, request_id: Hashable) -> None:
        pass

    def reset(self) -> None:
        """Drops every host page."""
        for page in self._lru:
            self.index.remove(page)
        self._lru.clear()
        self._empty = list(range(self.num_pages - 1, -1, -1))

    def shutdown(self) -> None:
        self.reset()

    def check_invariants(self, hasher: PageHasher) -> None:
        """Asserts each page is empty or cached (never both), and the index is sound."""
        occupied = set(self._lru)
        if occupied & set(self._empty) or len(occupied) + len(self._empty) != self.num_pages:
            raise AssertionError(f"host pages: {len(occupied)} cached + {len(self._empty)} empty != {self.num_pages}")
        if occupied != set(self.index.committed_pages()):
            raise AssertionError("host LRU and host index disagree on which pages are cached")
        self.index.check(hasher)

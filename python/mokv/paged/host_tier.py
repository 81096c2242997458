"""A host-memory tier under one replica's device prefix cache.

When the device pool evicts a cached block, its pages are copied (d2h) to a
host page, which keeps the block's identity (hash, uid, parent, tokens). A
later prefix lookup that misses on the device continues on the host tier; each
host hit is copied back (h2d) into a fresh device block. Host pages are evicted
least-recently-used first. The tier is inclusive: a restored page stays on the
host, so evicting the block again costs no second copy.

Copies go through MAX driver `Buffer` views of the raw pages (`to_memory()`),
so they work for any dtype and device; host pages live in CPU `Buffer`s. A
`Buffer` copy is only enqueued when the call returns (on the CPU too), so every
offload and restore waits for its copies: the evicted block is about to be
overwritten, and the restored one read by the next graph.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from max.driver import CPU, Buffer
from max.dtype import DType

from ..buffer import KVCacheMemory
from .block_pool import PageIndex
from .hashing import BlockHasher


class HostTier:
    """Host copies of evicted cached blocks of one replica.

    Args:
        num_pages: Host pages.
        page_size: Tokens per page.
        device_memory: The replica's device pages, as `KVCacheBuffer.to_memory()`.
        device_index: The replica's device prefix index (identity of evicted blocks).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device_memory: list[KVCacheMemory],
        device_index: PageIndex,
    ) -> None:
        self.num_pages = num_pages
        self.index = PageIndex(num_pages, page_size)
        self._device_memory = device_memory
        self._device_index = device_index
        self._pages = [
            Buffer.zeros([num_pages, unit.bytes_per_page], DType.uint8, device=CPU())
            for unit in device_memory
        ]
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Occupied, unpinned pages; least recently used first."""
        self._empty = list(range(num_pages - 1, -1, -1))

    @property
    def num_used(self) -> int:
        """Host pages holding a block."""
        return self.num_pages - len(self._empty)

    def _take_page(self) -> int | None:
        if self._empty:
            return self._empty.pop()
        if not self._lru:
            return None
        page, _ = self._lru.popitem(last=False)
        self.index.remove(page)
        return page

    def offload(self, block: int) -> bool:
        """Copies cached device `block` to the host; returns whether it copied.

        Nothing is copied when the host already holds this very block (same
        uid) or when every host page is pinned by a restore in progress.
        """
        block_hash = self._device_index.hash[block]
        assert block_hash is not None
        page = self.index.get(block_hash)
        if page is not None:
            if page not in self._lru:
                return False
            if self.index.uid[page] == self._device_index.uid[block]:
                self._lru.move_to_end(page)
                return False
            # A different block under the same hash: the newer one replaces it.
            del self._lru[page]
            self.index.remove(page)
        else:
            page = self._take_page()
            if page is None:
                return False
        for unit, host in zip(self._device_memory, self._pages, strict=True):
            host[page, :].inplace_copy_from(unit.buffer[block, :])
        self._wait_for_copies()
        self.index.copy_entry(page, self._device_index, block)
        self._lru[page] = None
        return True

    def pin(self, pages: Iterable[int]) -> None:
        """Keeps `pages` from being evicted until they are restored."""
        for page in pages:
            del self._lru[page]

    def restore(self, page: int, block: int) -> None:
        """Copies pinned host `page` into device `block` and unpins it."""
        for unit, host in zip(self._device_memory, self._pages, strict=True):
            for device_pages in unit.copies:
                device_pages[block, :].inplace_copy_from(host[page, :])
        self._wait_for_copies()
        self._lru[page] = None

    def _wait_for_copies(self) -> None:
        for unit in self._device_memory:
            for device_pages in unit.copies:
                device_pages.device.synchronize()
        for host in self._pages:
            host.device.synchronize()

    def reset(self) -> None:
        """Drops every host page."""
        for page in self._lru:
            self.index.remove(page)
        self._lru.clear()
        self._empty = list(range(self.num_pages - 1, -1, -1))

    def check_invariants(self, hasher: BlockHasher) -> None:
        """Asserts each page is empty or cached (never both), and the index is sound."""
        occupied = set(self._lru)
        if occupied & set(self._empty) or len(occupied) + len(self._empty) != self.num_pages:
            raise AssertionError(
                f"host pages: {len(occupied)} cached + {len(self._empty)} empty != {self.num_pages}"
            )
        if occupied != set(self.index.committed_slots()):
            raise AssertionError("host LRU and host index disagree on which pages are cached")
        self.index.check(hasher)

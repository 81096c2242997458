"""A write-through tier over a shared page store (a directory, a Redis server).

`StoreTier` is the `Tier` of every tier whose pages outlive the process. It
does what all of them share: it names pages by their cross-process keys,
copies committed device pages out (synchronously, since the page may be
handed out again at once) and hands them to background writer threads, which
encode a record per page (`record.RecordCodec`: tokens, chain, checksum or
MAC) and store it. On a lookup it fetches a prefix's records in one go after
probing the first (parallel file reads, one pipelined multi-get), verifies
each before anything touches a device page, and stops at the first miss or
rejection. A load only enqueues the copies into the fresh device pages; the
manager awaits them before `runtime_inputs` returns.

A `PageStore` is only bytes by key: where they live, how they are written
atomically, evicted and shared is the store's business (`disk.DiskStore`,
`remote.RedisStore`). A store that fails answers misses and drops writes; it
never raises into serving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from max.driver import Buffer

from ..buffer import KVCacheMemory
from ..prefix import NO_UID
from .base import PageToSave, PrefixQuery, SavePoint, TierMetrics, TierUsage
from .record import PageIdentity, RecordCodec, RecordError, Rejection

logger = logging.getLogger("mokv.tiers")

Record = bytes | memoryview
"""A stored page record as a store returns it."""


class PageStore:
    """Records by key: the interface `StoreTier` needs from a store.

    Implementations must be thread-safe: writers call `put_many` from
    background threads while lookups call `get_many`.
    """

    name: str = "store"
    errors: int = 0
    """I/O or connection failures so far, each served as a miss or a dropped write."""

    @property
    def enabled(self) -> bool:
        """False once the store has given up (for good, or until it retries)."""
        raise NotImplementedError

    def get_many(self, keys: Sequence[bytes]) -> list[Record | None]:
        """Each key's record, or None where it is missing or unreadable."""
        raise NotImplementedError

    def put_many(self, records: Sequence[tuple[bytes, list[Record]]]) -> int:
        """Stores `(key, record parts)` pairs; returns how many it stored."""
        raise NotImplementedError

    def discard(self, key: bytes) -> None:
        """Removes a record that failed verification."""
        raise NotImplementedError

    def clear(self) -> None:
        """Removes every record of this layout."""
        raise NotImplementedError

    def usage(self) -> TierUsage:
        raise NotImplementedError

    def close(self) -> None:
        """Releases files, threads and connections; idempotent."""
        raise NotImplementedError


class StoreTier:
    """One replica's write-through tier over a `PageStore` (a `Tier`).

    Args:
        store: Where records live (shared by every replica of the manager).
        codec: Encodes and verifies records of this cache's layout.
        device_memory: The replica's device pages (`KVCacheBuffer.to_memory()`).
        writers: Background writer threads.
        max_backlog_bytes: Most bytes of saves waiting for a writer; saves
            past it are dropped (and counted) rather than piling up in memory.
    """

    saves_on = SavePoint.COMMIT
    needs_keys = True

    def __init__(
        self,
        store: PageStore,
        codec: RecordCodec,
        device_memory: list[KVCacheMemory],
        *,
        writers: int = 2,
        max_backlog_bytes: int = 256 << 20,
    ) -> None:
        self.name = store.name
        self.store = store
        self.codec = codec
        self._metrics = TierMetrics()
        self._memory = device_memory
        self._host_views = [_host_views(unit) for unit in device_memory]
        """Per unit, numpy views of its host-resident copies (None on an accelerator)."""
        self._num_writers = writers
        widths = [unit.bytes_per_page for unit in device_memory]
        self._offsets = np.cumsum([0, *widths]).tolist()
        if self._offsets[-1] != codec.payload_bytes:
            raise ValueError(f"codec pages hold {codec.payload_bytes} bytes, the device's {self._offsets[-1]}")
        self._writers = ThreadPoolExecutor(max_workers=writers, thread_name_prefix=f"mokv-{self.name}-writer")
        self._verifiers = ThreadPoolExecutor(max_workers=writers, thread_name_prefix=f"mokv-{self.name}-verifier")
        self._max_backlog = max_backlog_bytes
        self._lock = threading.Lock()
        self._backlog = 0
        self._in_flight: set[Future[None]] = set()
        self._closed = False
        self._loads_in_flight: dict[Hashable, list[Buffer]] = {}
        """Per request, the host sources of copies enqueued into its device pages (kept alive until they land)."""

    @property
    def metrics(self) -> TierMetrics:
        """This tier's counters, the store's failures included."""
        with self._lock:
            return dataclasses.replace(self._metrics, errors=self._metrics.errors + self.store.errors)

    # ------------------------------------------------------------------- loads

    def lookup(self, query: PrefixQuery) -> list[memoryview]:
        """Verified payloads for the longest stored run of `query`'s pages."""
        if not len(query) or self._closed or not self.store.enabled:
            return []
        self._metrics.lookups += 1
        started = time.perf_counter()
        # The first page alone first: most lookups of a new prompt miss there,
        # and then one small read (or round trip) is all they cost.
        records = self.store.get_many(query.keys[:1])
        if records[0] is not None and len(query) > 1:
            records += self.store.get_many(query.keys[1:])
        found = next((i for i, record in enumerate(records) if record is None), len(records))
        parents = [query.parent_key, *query.keys[: found - 1]]
        checks = [
            (records[i], PageIdentity(query.keys[i], parents[i], query.tokens[i])) for i in range(found)
        ]  # verified in parallel: hashing a page releases the GIL
        verdicts = list(self._verifiers.map(self._verify, checks)) if found > 1 else [self._verify(c) for c in checks]
        payloads: list[memoryview] = []
        for (_, identity), verdict in zip(checks, verdicts, strict=True):
            if isinstance(verdict, RecordError):
                self._reject(identity.key, verdict)
                break
            payloads.append(verdict)
        self._metrics.load_seconds += time.perf_counter() - started
        return payloads

    def _verify(self, check: tuple[Record, PageIdentity]) -> memoryview | RecordError:
        try:
            return self.codec.verify(*check)
        except RecordError as error:
            return error

    def _reject(self, key: bytes, error: RecordError) -> None:
        self._metrics.rejected_pages += 1
        if error.reason is Rejection.UNAUTHENTICATED:
            # Possibly a record of a writer holding another key: not ours to remove.
            self._metrics.unauthenticated_pages += 1
        else:
            self.store.discard(key)
        logger.debug("%s tier: a stored page was rejected (%s)", self.name, error)

    def reserve(self, hits: Sequence[memoryview]) -> None:
        """Nothing to pin: the hits are host copies already."""

    def load(self, request_id: Hashable, hits: Sequence[memoryview], pages: Sequence[int]) -> list[int]:
        """Enqueues copies of verified payloads into device `pages` (awaited by
        `sync`); the pages get fresh uids."""
        sources: list[Buffer] = []
        for payload, page in zip(hits, pages, strict=True):
            row = np.frombuffer(payload, dtype=np.uint8)
            for unit, views, start, end in zip(
                self._memory, self._host_views, self._offsets, self._offsets[1:], strict=False
            ):
                if views is not None:  # host memory: a plain copy, done when it returns
                    for view in views:
                        view[page] = row[start:end]
                    continue
                source = Buffer.from_numpy(row[start:end])
                sources.append(source)
                for device_pages in unit.copies:
                    device_pages[page, :].inplace_copy_from(source)
        if sources:
            self._loads_in_flight.setdefault(request_id, []).extend(sources)
        self._metrics.hit_pages += len(hits)
        self._metrics.hit_bytes += len(hits) * self.codec.payload_bytes
        return [NO_UID] * len(hits)

    def sync(self) -> None:
        """Waits for every enqueued load copy."""
        if self._loads_in_flight:
            self._wait_for_devices()
            self._loads_in_flight.clear()

    def request_complete(self, request_id: Hashable) -> None:
        """Waits for the request's load copies, so its pages may be freed."""
        if request_id in self._loads_in_flight:
            self.sync()

    def _wait_for_devices(self) -> None:
        for unit in self._memory:
            for device_pages in unit.copies:
                device_pages.device.synchronize()

    # ------------------------------------------------------------------- saves

    def save(self, pages: Sequence[PageToSave]) -> int:
        """Copies committed device pages out now and queues their records for
        the writers; returns how many were queued."""
        if not pages or self._closed or not self.store.enabled:
            return 0
        size = len(pages) * self.codec.payload_bytes
        with self._lock:
            if self._backlog + size > self._max_backlog:
                self._metrics.dropped_saves += len(pages)
                return 0
            self._backlog += size
        copies = self._snapshot([item.page for item in pages])
        identities = [PageIdentity(item.key, item.parent_key, item.tokens) for item in pages]
        # One task per writer, each a contiguous share: hashing and writing run in parallel.
        share = -(-len(pages) // self._num_writers)
        for lo in range(0, len(pages), share):
            part = slice(lo, lo + share)
            chunk = len(identities[part]) * self.codec.payload_bytes
            future = self._writers.submit(self._write, identities[part], [c[part] for c in copies], chunk)
            with self._lock:
                self._in_flight.add(future)
            future.add_done_callback(self._written)
        return len(pages)

    def _snapshot(self, pages: list[int]) -> list[np.ndarray]:
        """Host copies `[len(pages), bytes_per_page]` of the pages in each memory unit."""
        copies = []
        for unit, views in zip(self._memory, self._host_views, strict=True):
            if views is not None:  # host memory: one gathering copy
                copies.append(views[0][pages])
                continue
            host = np.empty((len(pages), unit.bytes_per_page), np.uint8)
            copies.append(host)
            target = Buffer.from_numpy(host)
            for i, page in enumerate(pages):
                target[i, :].inplace_copy_from(unit.buffer[page, :])
            target.device.synchronize()
            self._wait_for_devices()
        return copies

    def _write(self, identities: list[PageIdentity], pages: list[np.ndarray], size: int) -> None:
        started = time.perf_counter()
        crashed = False
        try:
            records = [
                (identity.key, self.codec.encode(identity, [unit_pages[i].data for unit_pages in pages]))
                for i, identity in enumerate(identities)
            ]
            stored = self.store.put_many(records)
        except Exception:  # a writer must never die silently: log, count, go on
            logger.exception("%s tier: a background write failed", self.name)
            stored, crashed = 0, True
        with self._lock:
            self._metrics.errors += crashed
            self._backlog -= size
            self._metrics.saved_pages += stored
            self._metrics.saved_bytes += stored * self.codec.payload_bytes
            self._metrics.dropped_saves += len(identities) - stored
            self._metrics.save_seconds += time.perf_counter() - started

    def _written(self, future: Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(future)

    def flush(self) -> None:
        """Waits until every queued save has been written (or given up)."""
        while True:
            with self._lock:
                pending = list(self._in_flight)
            if not pending:
                return
            for future in pending:
                future.result()

    # --------------------------------------------------------------- lifetime

    def reset(self) -> None:
        """Waits for queued saves, then removes every record of this layout."""
        self.flush()
        self.store.clear()

    def shutdown(self) -> None:
        """Waits for loads and saves, stops the writers and closes the store;
        the tier answers misses and takes no saves from then on."""
        if self._closed:
            return
        self._closed = True
        self.sync()
        self.flush()
        self._writers.shutdown(wait=True)
        self._verifiers.shutdown(wait=True)
        self.store.close()

    def usage(self) -> TierUsage:
        return self.store.usage()


def _host_views(unit: KVCacheMemory) -> list[np.ndarray] | None:
    """Numpy views (no copy) of every copy of `unit`'s pages when all live in
    host memory, so pages move by plain memcpy; None otherwise."""
    if not all(copy.device.is_host for copy in unit.copies):
        return None
    return [copy.to_numpy() for copy in unit.copies]

"""`PagedKVCacheManager`: hands pages to requests, reuses cached prefixes, builds graph inputs.

The lifecycle of a request on replica r (MAX's documented API):

    claim(id, r)          reserve a row for the request
    alloc(ctx, r)         give it pages for its next step (prefix hits first)
    runtime_inputs(...)   graph inputs for a batch of allocated requests
    ctx.update(token)     the model ran; the step's tokens are now cached
    step(batches)         commit newly full pages to the prefix cache
    release(id, r)        give its pages back (cached ones stay reusable)

Every replica has its own block pool, block tensor, block table and (optionally)
host tier; `replica_idx` routes each call, and a request lives on one replica
from `claim` to `release`.

Costs: bookkeeping is O(1) per block (the pool is lists and an OrderedDict);
hashing and token checks are numpy over a request's new full blocks; a batch's
lookup table is one numpy gather. Nothing loops over tokens in Python.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from max.driver import Device
from max.engine import InferenceSession

from ..buffer import KVCacheBuffer
from ..context import TextContext
from ..metrics import KVCacheMetrics
from ..params import KVCacheParams, KVCacheStrategy
from .block_pool import NO_UID, BlockPool
from .hashing import BlockHasher
from .host_tier import HostTier
from .runtime_inputs import (
    BatchCharacteristics,
    BlockTable,
    PagedCacheInputs,
    build_paged_inputs,
)


class InsufficientBlocksError(RuntimeError):
    """There are not enough free blocks for an allocation; nothing was changed."""


@dataclass(eq=False, slots=True)
class _Request:
    """What the manager tracks for one claimed request."""

    replica_idx: int
    row: int
    """Row of the replica's block table holding the request's page ids."""
    num_blocks: int = 0
    hashes: list[int] = field(default_factory=list)
    """Chained hash of each full block hashed so far (never the last token's block)."""
    num_committed: int = 0
    """Leading blocks already offered to the prefix cache (or taken from it)."""
    last_uid: int = NO_UID
    """uid of block `num_committed - 1`: the parent of the next block to commit."""
    chain_broken: bool = False
    """A block could not be committed, so later blocks have no verifiable parent."""
    is_dummy: bool = False


class _Replica:
    """One data-parallel replica: its memory, block pool, block table and host tier."""

    def __init__(
        self,
        params: KVCacheParams,
        total_num_pages: int,
        total_num_host_pages: int,
        max_batch_size: int,
        devices: Sequence[Device],
        buffer: KVCacheBuffer,
    ) -> None:
        self.devices = list(devices)
        self.buffer = buffer
        self.metrics = KVCacheMetrics()
        self.pool = BlockPool(total_num_pages, params.page_size)
        self.host: HostTier | None = None
        if total_num_host_pages:
            self.host = HostTier(
                total_num_host_pages, params.page_size, buffer.to_memory(), self.pool.index
            )
            self.pool.on_evict = self._offload
        self.table = BlockTable(null_page=total_num_pages, initial_rows=max_batch_size)

    def _offload(self, block: int) -> None:
        assert self.host is not None
        if self.host.offload(block):
            self.metrics.d2h_blocks_copied += 1


class PagedKVCacheManager:
    """Paged KV cache manager with data parallelism and optional prefix caching.

    Args:
        params: Cache shape and policy (`cache_strategy` must be PAGED).
        session: The inference session the cache serves (kept for API parity
            with MAX; buffers are allocated on `params.devices` directly).
        total_num_pages: Device pages per replica, not counting the null page.
        total_num_host_pages: Host-tier pages per replica; 0 disables the tier.
        enable_runtime_checks: Assert the pool invariants after every call.
        max_batch_size: Most requests one replica's `runtime_inputs` batch may hold.
    """

    def __init__(
        self,
        params: KVCacheParams,
        session: InferenceSession | None,
        total_num_pages: int,
        total_num_host_pages: int = 0,
        enable_runtime_checks: bool = False,
        *,
        max_batch_size: int,
    ) -> None:
        if params.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError(
                f"PagedKVCacheManager needs cache_strategy=PAGED, got {params.cache_strategy.value}"
            )
        if total_num_pages < 1:
            raise ValueError(f"total_num_pages must be positive, got {total_num_pages}")
        if total_num_host_pages < 0:
            raise ValueError(f"total_num_host_pages must be >= 0, got {total_num_host_pages}")
        if total_num_host_pages and not params.enable_prefix_caching:
            raise ValueError(
                f"total_num_host_pages={total_num_host_pages} needs enable_prefix_caching=True: "
                "the host tier only keeps prefix-cached blocks"
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.params = params
        self.session = session
        self.page_size = params.page_size
        self.total_num_pages = total_num_pages
        self.total_num_host_pages = total_num_host_pages
        self.max_batch_size = max_batch_size
        self.enable_runtime_checks = enable_runtime_checks
        self._prefix_caching = params.enable_prefix_caching
        self._hasher = BlockHasher(params.page_size)
        self._replicas = [
            _Replica(
                params,
                total_num_pages,
                total_num_host_pages,
                max_batch_size,
                [ref.to_device() for ref in refs],
                KVCacheBuffer.allocate(params, total_num_pages + 1, refs),
            )
            for refs in params.devices_per_replica
        ]
        self._requests: dict[str, _Request] = {}

    # ----------------------------------------------------------------- routing

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas, each with its own pool."""
        return len(self._replicas)

    def _replica(self, replica_idx: int) -> _Replica:
        if not 0 <= replica_idx < len(self._replicas):
            raise ValueError(
                f"replica_idx={replica_idx} is out of range: "
                f"there are {len(self._replicas)} replicas"
            )
        return self._replicas[replica_idx]

    def _request(self, request_id: str, replica_idx: int) -> _Request:
        req = self._requests.get(request_id)
        if req is None or req.replica_idx != replica_idx:
            self._replica(replica_idx)
            where = "not claimed" if req is None else f"claimed on replica {req.replica_idx}"
            raise ValueError(f"request {request_id!r} is {where}, not on replica {replica_idx}")
        return req

    # --------------------------------------------------------------- lifecycle

    def claim(self, request_id: str, replica_idx: int = 0) -> None:
        """Reserves a slot for `request_id` on replica `replica_idx`."""
        replica = self._replica(replica_idx)
        owner = self._requests.get(request_id)
        if owner is not None:
            raise ValueError(
                f"request {request_id!r} is already claimed on replica {owner.replica_idx}"
            )
        self._requests[request_id] = _Request(replica_idx, replica.table.add_row())

    def contains(self, request_id: str, replica_idx: int = 0) -> bool:
        """Whether `request_id` is claimed on replica `replica_idx`."""
        self._replica(replica_idx)
        req = self._requests.get(request_id)
        return req is not None and req.replica_idx == replica_idx

    def alloc_dummy(self, request_id: str, replica_idx: int = 0) -> None:
        """Claims a padding request whose only page is the null page."""
        self.claim(request_id, replica_idx)
        req = self._requests[request_id]
        req.num_blocks = 1  # table rows start out null
        req.is_dummy = True

    def alloc(self, data: TextContext, replica_idx: int = 0, num_steps: int = 1) -> None:
        """Gives a claimed request pages for its next `num_steps` steps.

        With prefix caching, the longest verified run of cached blocks (device
        first, then host tier) continuing the request's committed blocks is
        reused and `data` skips their tokens; the last token is never served
        from cache, since the model must run it.

        Raises:
            InsufficientBlocksError: Too few free blocks. The pool, the request
                and `data` are left exactly as they were.
        """
        req = self._request(data.request_id, replica_idx)
        if req.is_dummy:
            raise ValueError(f"request {data.request_id!r} is a dummy and holds only the null page")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        replica = self._replicas[replica_idx]
        ps = self.page_size
        seq_len = data.current_length + num_steps - 1
        if seq_len > self.total_num_pages * ps:
            raise InsufficientBlocksError(
                f"request {data.request_id!r} needs {seq_len} tokens of KV but a replica holds "
                f"only {self.total_num_pages * ps} ({self.total_num_pages} pages of {ps} tokens)"
            )
        num_new = -(-seq_len // ps) - req.num_blocks
        if self._prefix_caching and data.active_length > 1:
            device_hits, host_hits, hit_hashes = self._find_prefix_hits(replica, req, data)
            if device_hits or num_new > 0:
                self._extend(
                    replica,
                    req,
                    data,
                    max(0, num_new - len(device_hits)),
                    device_hits,
                    host_hits,
                    hit_hashes,
                )
        elif num_new > 0:
            self._extend(replica, req, data, num_new, [], [], [])
        replica.metrics.input_tokens += data.active_length
        self._check(replica)

    def _extend(
        self,
        replica: _Replica,
        req: _Request,
        data: TextContext,
        num_new: int,
        device_hits: list[int],
        host_hits: list[int],
        hit_hashes: list[int],
    ) -> None:
        """Appends cached `device_hits`, then `num_new` fresh blocks (the first
        `len(host_hits)` of them filled from the host tier), to the request."""
        pool = replica.pool
        free_after_hits = pool.num_free - sum(1 for b in device_hits if pool.ref_count[b] == 0)
        if num_new > free_after_hits:
            in_use = self.total_num_pages - pool.num_free
            raise InsufficientBlocksError(
                f"request {data.request_id!r} needs {num_new} new blocks on replica "
                f"{req.replica_idx} but only {free_after_hits} are free "
                f"({in_use}/{self.total_num_pages} in use)"
            )
        for block in device_hits:
            pool.touch(block)
        host = replica.host
        if host_hits:
            assert host is not None
            host.pin(host_hits)
        new_blocks = pool.allocate(num_new)
        last_uid = pool.index.uid[device_hits[-1]] if device_hits else req.last_uid
        for page, block, block_hash in zip(
            host_hits, new_blocks, hit_hashes[len(device_hits) :], strict=False
        ):
            assert host is not None
            host.restore(page, block)
            last_uid = pool.commit(
                block,
                block_hash,
                host.index.parent_uid[page],
                host.index.parent_hash[page],
                host.index.tokens[page],
                uid=host.index.uid[page],
            )
        replica.table.write(req.row, req.num_blocks, device_hits + new_blocks)
        req.num_blocks += len(device_hits) + len(new_blocks)
        num_hits = len(device_hits) + len(host_hits)
        if num_hits:
            req.num_committed += num_hits
            req.last_uid = last_uid
            data.skip_processing(num_hits * self.page_size)
            replica.metrics.cache_tokens += num_hits * self.page_size
            replica.metrics.h2d_blocks_copied += len(host_hits)

    def _hash_new_blocks(self, req: _Request, data: TextContext) -> None:
        """Extends `req.hashes` to every full block before the last token."""
        ps = self.page_size
        done = len(req.hashes)
        hashable = (data.current_length - 1) // ps
        if hashable > done:
            parent = req.hashes[-1] if done else None
            req.hashes.extend(
                self._hasher.hash_blocks(data.tokens[done * ps : hashable * ps], parent)
            )

    def _find_prefix_hits(
        self, replica: _Replica, req: _Request, data: TextContext
    ) -> tuple[list[int], list[int], list[int]]:
        """Verified cached blocks continuing the request: (device blocks, host pages, their hashes).

        Only a request whose cached state ends exactly at its committed blocks
        (a new request, in practice) can take hits.
        """
        ps = self.page_size
        start = req.num_committed
        if req.chain_broken or req.num_blocks != start or data.processed_length != start * ps:
            return [], [], []
        self._hash_new_blocks(req, data)
        wanted = req.hashes[start:]
        if not wanted:
            return [], [], []
        tokens = data.tokens[start * ps : (start + len(wanted)) * ps].reshape(len(wanted), ps)
        index = replica.pool.index
        device_hits = index.match(wanted, req.last_uid, tokens)
        host_hits: list[int] = []
        n = len(device_hits)
        if replica.host is not None and n < len(wanted):
            parent_uid = index.uid[device_hits[-1]] if device_hits else req.last_uid
            # A hash the device still maps (to a block that failed verification)
            # cannot be committed again, so host hits stop there.
            rest = wanted[n:]
            clash = next((i for i, h in enumerate(rest) if index.get(h) is not None), len(rest))
            host_hits = replica.host.index.match(rest[:clash], parent_uid, tokens[n : n + clash])
        return device_hits, host_hits, wanted[: n + len(host_hits)]

    def step(self, batches: Sequence[Sequence[TextContext]]) -> None:
        """Commits each request's newly completed blocks to the prefix cache.

        `batches[r]` holds replica r's requests. A completed block whose
        verified twin is already cached is swapped for that twin (dedup) and
        its own block freed.
        """
        ps = self.page_size
        for replica_idx, batch in enumerate(batches):
            replica = self._replica(replica_idx)
            for data in batch:
                req = self._request(data.request_id, replica_idx)
                if (
                    self._prefix_caching
                    and data.processed_length // ps > req.num_committed
                    and not (req.is_dummy or req.chain_broken)
                ):
                    self._commit(replica, req, data)
            self._check(replica)

    def _commit(self, replica: _Replica, req: _Request, data: TextContext) -> None:
        """Commits the request's blocks up to `processed_length` (deduplicating)."""
        ps = self.page_size
        first = req.num_committed
        full = min(data.processed_length // ps, req.num_blocks)
        self._hash_new_blocks(req, data)
        pool = replica.pool
        index = pool.index
        tokens = data.tokens[first * ps : full * ps].reshape(full - first, ps)
        for j, block in enumerate(replica.table.read(req.row, first, full)):
            i = first + j
            block_hash = req.hashes[i]
            cached = index.get(block_hash)
            if cached is not None and index.holds(cached, req.last_uid, tokens[j]):
                pool.touch(cached)
                pool.free([block])
                replica.table.write(req.row, i, [cached])
                uid = index.uid[cached]
            else:
                if cached is not None:
                    if pool.ref_count[cached]:
                        req.chain_broken = True
                        return
                    # An unverifiable (orphaned or colliding) entry nobody holds.
                    pool.uncommit(cached)
                parent_hash = req.hashes[i - 1] if i else None
                uid = pool.commit(block, block_hash, req.last_uid, parent_hash, tokens[j])
            req.last_uid = uid
            req.num_committed = i + 1

    def release(self, request_id: str, replica_idx: int = 0) -> None:
        """Returns a request's pages; cached ones stay reusable until evicted.

        Blocks go back tail first when prefix caching is on, so the shared
        head of a prefix is evicted last.
        """
        req = self._request(request_id, replica_idx)
        replica = self._replicas[replica_idx]
        if not req.is_dummy:
            blocks = replica.table.read(req.row, 0, req.num_blocks)
            if self._prefix_caching:
                blocks.reverse()
            replica.pool.free(blocks)
        replica.table.drop_row(req.row, req.num_blocks)
        del self._requests[request_id]
        self._check(replica)

    @contextlib.contextmanager
    def reserve(self, replica_batches: Sequence[Sequence[TextContext]]) -> Iterator[None]:
        """Claims and allocates `replica_batches[r]` on replica r for the scope, then releases them.

        For throwaway flows such as warm-up: on any error, whatever was
        claimed so far is released before the error propagates.
        """
        claimed: list[tuple[str, int]] = []
        try:
            for replica_idx, batch in enumerate(replica_batches):
                for data in batch:
                    self.claim(data.request_id, replica_idx)
                    claimed.append((data.request_id, replica_idx))
                    self.alloc(data, replica_idx)
            yield
        finally:
            for request_id, replica_idx in reversed(claimed):
                self.release(request_id, replica_idx)

    # ------------------------------------------------------------ graph inputs

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[TextContext]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
        num_steps: int = 1,
    ) -> list[PagedCacheInputs]:
        """Graph inputs for one batch per replica (see `paged.runtime_inputs`).

        Returns one `PagedCacheInputs` per device, replica-major: exactly one
        per replica batch when each replica has a single device.

        Raises:
            ValueError: Wrong number of batches, a batch over `max_batch_size`,
                or a request without pages for this step (call `alloc` first).
        """
        if len(batches) != len(self._replicas):
            raise ValueError(
                f"expected one batch per replica ({len(self._replicas)}), got {len(batches)}"
            )
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        inputs: list[PagedCacheInputs] = []
        for replica_idx, (replica, batch) in enumerate(zip(self._replicas, batches, strict=True)):
            n = len(batch)
            if n > self.max_batch_size:
                raise ValueError(
                    f"replica {replica_idx} batch has {n} requests, "
                    f"max_batch_size is {self.max_batch_size}"
                )
            per_request: list[int] = []
            for data in batch:
                req = self._request(data.request_id, replica_idx)
                per_request += (req.row, data.processed_length, data.current_length, req.num_blocks)
            rows, processed, current, held = np.array(per_request, dtype=np.int64).reshape(n, 4).T
            inputs += build_paged_inputs(
                replica.table,
                rows,
                processed,
                current,
                held,
                [d.request_id for d in batch],
                page_size=self.page_size,
                num_steps=num_steps,
                max_cache_length=max_cache_length,
                batch_characteristics=batch_characteristics,
                blocks=replica.buffer.values,
                devices=replica.devices,
            )
        return inputs

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[TextContext]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
        num_steps: int = 1,
    ) -> list[PagedCacheInputs]:
        """`runtime_inputs`: mokv caches are always a single leaf (no multi-cache trees)."""
        return self.runtime_inputs(
            batches,
            max_cache_length=max_cache_length,
            batch_characteristics=batch_characteristics,
            num_steps=num_steps,
        )

    def get_device_buffer(self, replica_idx: int = 0) -> KVCacheBuffer:
        """The replica's block tensors (one per TP shard)."""
        return self._replica(replica_idx).buffer

    # ----------------------------------------------------------------- queries

    def get_req_blocks(self, request_id: str, replica_idx: int = 0) -> list[int]:
        """The request's page ids, in token order."""
        req = self._request(request_id, replica_idx)
        return self._replicas[replica_idx].table.read(req.row, 0, req.num_blocks)

    def get_num_pages(self, replica_idx: int = 0) -> int:
        """Device pages of the replica (the null page not counted)."""
        self._replica(replica_idx)
        return self.total_num_pages

    def get_num_used_pages(self, replica_idx: int = 0) -> int:
        """Device pages some request holds."""
        return self.total_num_pages - self._replica(replica_idx).pool.num_free

    def get_num_host_pages(self, replica_idx: int = 0) -> int:
        """Host-tier pages of the replica."""
        self._replica(replica_idx)
        return self.total_num_host_pages

    def get_num_used_host_pages(self, replica_idx: int = 0) -> int:
        """Host-tier pages holding an evicted block."""
        host = self._replica(replica_idx).host
        return 0 if host is None else host.num_used

    def get_num_disk_pages(self, replica_idx: int = 0) -> int:
        """Disk-tier pages: mokv has no disk tier."""
        self._replica(replica_idx)
        return 0

    def get_num_used_disk_pages(self, replica_idx: int = 0) -> int:
        """Used disk-tier pages: always 0."""
        self._replica(replica_idx)
        return 0

    def num_free_blocks(self, replica_idx: int = 0) -> int:
        """Blocks no request holds (free or cached) on the replica."""
        return self._replica(replica_idx).pool.num_free

    def total_num_blocks(self, replica_idx: int = 0) -> int:
        """Blocks of the replica's pool."""
        self._replica(replica_idx)
        return self.total_num_pages

    def get_pct_used_blocks_after_allocation(self, ctx: TextContext, replica_idx: int = 0) -> float:
        """Fraction (0..1, capped) of the replica's blocks in use if `ctx` got all
        the pages its tokens need now, ignoring prefix hits; for admission control."""
        replica = self._replica(replica_idx)
        req = self._requests.get(ctx.request_id)
        held = req.num_blocks if req is not None and req.replica_idx == replica_idx else 0
        needed = max(0, -(-ctx.current_length // self.page_size) - held)
        used = self.total_num_pages - replica.pool.num_free
        return min(1.0, (used + needed) / self.total_num_pages)

    # ----------------------------------------------------------------- metrics

    def get_metrics_aggregated(self) -> KVCacheMetrics:
        """Metrics summed over replicas."""
        return sum((r.metrics for r in self._replicas), KVCacheMetrics())

    def reset_metrics(self) -> None:
        """Zeroes every replica's metrics."""
        for replica in self._replicas:
            replica.metrics = KVCacheMetrics()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block no request holds, on the device and host tiers."""
        for replica in self._replicas:
            replica.pool.reset_prefix_cache()
            if replica.host is not None:
                replica.host.reset()
            self._check(replica)

    # ------------------------------------------------------------------ checks

    def _check(self, replica: _Replica) -> None:
        if not self.enable_runtime_checks:
            return
        holders: Counter[int] = Counter()
        for req in self._requests.values():
            if self._replicas[req.replica_idx] is replica and not req.is_dummy:
                holders.update(replica.table.read(req.row, 0, req.num_blocks))
        replica.pool.check_invariants(holders, self._hasher)
        if replica.host is not None:
            replica.host.check_invariants(self._hasher)

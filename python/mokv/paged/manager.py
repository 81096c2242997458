"""`PagedKVCacheManager`: routes requests to replicas, validates calls, builds graph inputs.

The lifecycle of a request on replica r (MAX's documented API):

    claim(id, r)          reserve a row for the request
    alloc(ctx, r)         give it pages for its next step (prefix hits first)
    runtime_inputs(...)   graph inputs for a batch of allocated requests
    ctx.update(token)     the model ran; the step's tokens are now cached
    step(batches)         commit newly full pages to the prefix cache
    release(id, r)        give its pages back (cached ones stay reusable)

Contexts may be mokv's `TextContext` or MAX's own (`mokv.context.cache_context`
adapts them). Each replica (`replica.Replica`) has its own block pool, block
table and lower tiers (host memory, disk, remote store: `mokv.connectors`),
and holds the per-request policy; a request lives on one replica from `claim`
to `release`. With `MultiKVCacheParams` every replica
allocates one block tensor per leaf cache and one block id names the same page
in all of them, so a claim, an allocation and a prefix hit cover every cache.

Costs: bookkeeping is O(1) per block (the pool is lists and an OrderedDict);
hashing and token checks are numpy over a request's new full blocks; a batch's
lookup table is one numpy gather. Nothing loops over tokens in Python.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence

import numpy as np
from max.engine import InferenceSession

from ..buffer import KVCacheBuffer
from ..connectors.base import TierMetrics, TierUsage
from ..connectors.config import KVConnectorConfig, tier_factory
from ..context import cache_context
from ..contract import KVCacheInputs, MultiKVCacheInputs, PagedCacheInputs
from ..metrics import KVCacheMetrics
from ..params import (
    SINGLE_CACHE,
    AnyKVCacheParams,
    KVCacheParams,
    KVCacheStrategy,
    MultiKVCacheParams,
    resolve_params,
)
from .hashing import BlockHasher
from .replica import InsufficientBlocksError, Replica
from .runtime_inputs import BatchCharacteristics, batch_tables, device_inputs

__all__ = ["InsufficientBlocksError", "PagedKVCacheManager"]


class PagedKVCacheManager:
    """Paged KV cache manager with data parallelism and optional prefix caching.

    Args:
        params: Cache shape and policy: a `KVCacheParams` (its `cache_strategy`
            must be PAGED), a `MultiKVCacheParams`, or MAX's own
            `MHAKVCacheParams` / `MultiKVCacheParams` (converted by
            `mokv.params.from_max`, which refuses what mokv does not support).
        session: The inference session the cache serves (kept for API parity
            with MAX; buffers are allocated on `params.devices` directly).
        total_num_pages: Device pages per replica for requests; each block
            tensor has one more, the null page (`mokv.contract`).
        total_num_host_pages: Host-tier pages per replica; 0 takes
            `params.num_host_pages` (from `host_kvcache_swap_space_gb`, 0 when
            swapping is off), and no pages disable the tier.
        enable_runtime_checks: Assert the pool invariants after every call.
        max_batch_size: Most requests one replica's `runtime_inputs` batch may hold.
        connector_config: The disk and remote tiers (`KVConnectorConfig`);
            None for none. Call `shutdown()` (or use the manager as a context
            manager) to let their background writes finish.
    """

    def __init__(
        self,
        params: AnyKVCacheParams,
        session: InferenceSession | None,
        total_num_pages: int,
        total_num_host_pages: int = 0,
        enable_runtime_checks: bool = False,
        *,
        max_batch_size: int,
        connector_config: KVConnectorConfig | None = None,
    ) -> None:
        params = resolve_params(params)
        if params.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError(
                f"PagedKVCacheManager needs cache_strategy=PAGED, got {params.cache_strategy.value}"
            )
        if total_num_pages < 1:
            raise ValueError(f"total_num_pages must be positive, got {total_num_pages}")
        if total_num_host_pages < 0:
            raise ValueError(f"total_num_host_pages must be >= 0, got {total_num_host_pages}")
        total_num_host_pages = total_num_host_pages or params.num_host_pages
        if total_num_host_pages and not params.enable_prefix_caching:
            raise ValueError(
                f"total_num_host_pages={total_num_host_pages} needs enable_prefix_caching=True: "
                "the host tier only keeps prefix-cached blocks"
            )
        if connector_config is not None and connector_config.enabled and not params.enable_prefix_caching:
            raise ValueError(
                "the disk and remote tiers of connector_config need enable_prefix_caching=True: "
                "they only keep prefix-cached blocks"
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
        self._hasher = BlockHasher(params.page_size)
        leaves = params.leaves()
        tiers = tier_factory(params, total_num_pages, total_num_host_pages, connector_config)
        self._replicas = [
            Replica(
                index,
                total_num_pages,
                tiers,
                params.page_size,
                params.enable_prefix_caching,
                max_batch_size,
                [ref.to_device() for ref in refs],
                {name: KVCacheBuffer.allocate(leaf, total_num_pages, refs) for name, leaf in leaves.items()},
                self._hasher,
            )
            for index, refs in enumerate(params.devices_per_replica)
        ]
        self._replica_of: dict[Hashable, Replica] = {}

    # ----------------------------------------------------------------- routing

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas, each with its own pool."""
        return len(self._replicas)

    def _replica(self, replica_idx: int) -> Replica:
        if not 0 <= replica_idx < len(self._replicas):
            raise ValueError(
                f"replica_idx={replica_idx} is out of range: there are {len(self._replicas)} replicas"
            )
        return self._replicas[replica_idx]

    def _claimed_on(self, request_id: Hashable, replica_idx: int) -> Replica:
        """The replica holding `request_id`, which must be `replica_idx`."""
        replica = self._replica(replica_idx)
        owner = self._replica_of.get(request_id)
        if owner is not replica:
            where = "not claimed" if owner is None else f"claimed on replica {owner.index}"
            raise ValueError(f"request {request_id!r} is {where}, not on replica {replica_idx}")
        return replica

    # --------------------------------------------------------------- lifecycle

    def claim(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Reserves a slot for `request_id` on replica `replica_idx`."""
        self._claim(request_id, replica_idx, dummy=False)

    def _claim(self, request_id: Hashable, replica_idx: int, *, dummy: bool) -> None:
        replica = self._replica(replica_idx)
        owner = self._replica_of.get(request_id)
        if owner is not None:
            raise ValueError(f"request {request_id!r} is already claimed on replica {owner.index}")
        replica.claim(request_id, dummy=dummy)
        self._replica_of[request_id] = replica

    def contains(self, request_id: Hashable, replica_idx: int = 0) -> bool:
        """Whether `request_id` is claimed on replica `replica_idx`."""
        return self._replica_of.get(request_id) is self._replica(replica_idx)

    def alloc_dummy(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Claims a padding request whose only page is the null page."""
        self._claim(request_id, replica_idx, dummy=True)

    def alloc(self, data: object, replica_idx: int = 0, num_steps: int = 1) -> None:
        """Gives a claimed request pages for its next `num_steps` steps.

        `data` is a mokv or MAX `TextContext`. With prefix caching, the longest
        verified run of cached blocks (device first, then host tier) continuing
        the request's committed blocks is reused and `data` skips their tokens
        (on a first admission `data.cached_prefix_length` records how many, as
        MAX's manager does); the last token is never served from cache, since
        the model must run it.

        Raises:
            InsufficientBlocksError: Too few free blocks. The pool, the request
                and `data` are left exactly as they were.
        """
        ctx = cache_context(data)
        replica = self._claimed_on(ctx.request_id, replica_idx)
        if replica.requests[ctx.request_id].is_dummy:
            raise ValueError(f"request {ctx.request_id!r} is a dummy and holds only the null page")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        replica.alloc(ctx, num_steps)
        self._check(replica)

    def step(self, batches: Sequence[Sequence[object]]) -> None:
        """Commits each request's newly completed blocks to the prefix cache.

        `batches[r]` holds replica r's requests. A completed block whose
        verified twin is already cached is swapped for that twin (dedup) and
        its own block freed.
        """
        for replica_idx, batch in enumerate(batches):
            replica = self._replica(replica_idx)
            for data in batch:
                ctx = cache_context(data)
                self._claimed_on(ctx.request_id, replica_idx)
                replica.commit(ctx)
            self._check(replica)

    def release(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Returns a request's pages; cached ones stay reusable until evicted.

        Blocks go back tail first when prefix caching is on, so the shared
        head of a prefix is evicted last.
        """
        replica = self._claimed_on(request_id, replica_idx)
        replica.release(request_id)
        del self._replica_of[request_id]
        self._check(replica)

    @contextlib.contextmanager
    def reserve(self, replica_batches: Sequence[Sequence[object]]) -> Iterator[None]:
        """Claims and allocates `replica_batches[r]` on replica r for the scope, then releases them.

        For throwaway flows such as warm-up: on any error, whatever was
        claimed so far is released before the error propagates.
        """
        claimed: list[tuple[Hashable, int]] = []
        try:
            for replica_idx, batch in enumerate(replica_batches):
                for data in batch:
                    request_id = cache_context(data).request_id
                    self.claim(request_id, replica_idx)
                    claimed.append((request_id, replica_idx))
                    self.alloc(data, replica_idx)
            yield
        finally:
            for request_id, replica_idx in reversed(claimed):
                self.release(request_id, replica_idx)

    # ------------------------------------------------------------ graph inputs

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[object]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
        num_steps: int = 1,
    ) -> KVCacheInputs | MultiKVCacheInputs:
        """Graph inputs for one batch per replica (the contract: `mokv.contract`).

        Returns a `KVCacheInputs` leaf whose `.inputs` hold one
        `PagedCacheInputs` per device, replica-major (for a
        `MultiKVCacheParams`, a `MultiKVCacheInputs` tree of such leaves);
        `.flatten()` is the graph's argument order. Row b of every table is
        `batches[r][b]`'s; `max_cache_length` fixes the lookup table's width
        (for a graph captured at that shape) and `batch_characteristics` the
        `max_lengths` row (upper bounds the batch must not exceed).

        Raises:
            ValueError: Wrong number of batches, a batch over `max_batch_size`,
                or a request without pages for this step (call `alloc` first).
        """
        if len(batches) != len(self._replicas):
            raise ValueError(f"expected one batch per replica ({len(self._replicas)}), got {len(batches)}")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        per_leaf: dict[str, list[PagedCacheInputs]] = {name: [] for name in self.params.leaves()}
        for replica, batch in zip(self._replicas, batches, strict=True):
            n = len(batch)
            if n > self.max_batch_size:
                raise ValueError(
                    f"replica {replica.index} batch has {n} requests, max_batch_size is {self.max_batch_size}"
                )
            per_request: list[int] = []
            request_ids = []
            for data in batch:
                ctx = cache_context(data)
                self._claimed_on(ctx.request_id, replica.index)
                state = replica.requests[ctx.request_id]
                per_request += (state.row, ctx.processed_length, ctx.current_length, state.num_blocks)
                request_ids.append(ctx.request_id)
            rows, processed, current, held = np.array(per_request, dtype=np.int64).reshape(n, 4).T
            tables = batch_tables(
                replica.table,
                rows,
                processed,
                current,
                held,
                request_ids,
                page_size=self.page_size,
                num_steps=num_steps,
                max_cache_length=max_cache_length,
                batch_characteristics=batch_characteristics,
            )
            for name, buffer in replica.buffers.items():
                per_leaf[name] += device_inputs(tables, buffer.values, replica.devices)
            replica.wait_for_loads()  # blocks loaded from a tier hold their bytes before the graph runs
        return _as_tree(self.params, per_leaf)

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[object]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
        num_steps: int = 1,
    ) -> KVCacheInputs:
        """`runtime_inputs` narrowed to its `KVCacheInputs` leaf, for single-cache models.

        Raises:
            AssertionError: The manager serves a `MultiKVCacheParams` tree (as
                MAX documents for this method); call `runtime_inputs` instead.
        """
        if isinstance(self.params, MultiKVCacheParams):
            raise AssertionError(
                f"runtime_inputs_for_leaf needs a single cache, but this manager serves "
                f"{len(self.params.leaves())} ({', '.join(self.params.leaves())}): use runtime_inputs"
            )
        inputs = self.runtime_inputs(
            batches,
            max_cache_length=max_cache_length,
            batch_characteristics=batch_characteristics,
            num_steps=num_steps,
        )
        assert isinstance(inputs, KVCacheInputs)
        return inputs

    def get_device_buffer(self, replica_idx: int = 0) -> KVCacheBuffer | dict[str, KVCacheBuffer]:
        """The replica's block tensors (one per TP shard); for a
        `MultiKVCacheParams`, one `KVCacheBuffer` per leaf cache by name."""
        buffers = self._replica(replica_idx).buffers
        if isinstance(self.params, MultiKVCacheParams):
            return dict(buffers)
        (buffer,) = buffers.values()
        return buffer

    # ----------------------------------------------------------------- queries

    def get_req_blocks(self, request_id: Hashable, replica_idx: int = 0) -> list[int]:
        """The request's page ids, in token order."""
        return self._claimed_on(request_id, replica_idx).blocks_of(request_id)

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
        """Pages the disk tier's budget holds (0 without a disk tier)."""
        usage = self.get_tier_usage(replica_idx).get("disk")
        return 0 if usage is None else usage.total_pages

    def get_num_used_disk_pages(self, replica_idx: int = 0) -> int:
        """Page files of the disk tier this process knows of (its own, those
        found at start-up and those it hit)."""
        usage = self.get_tier_usage(replica_idx).get("disk")
        return 0 if usage is None else usage.used_pages

    def get_tier_usage(self, replica_idx: int = 0) -> dict[str, TierUsage]:
        """Occupancy of each lower tier of the replica, by tier name, in lookup order."""
        return {c.name: c.usage() for c in self._replica(replica_idx).connectors}

    def num_free_blocks(self, replica_idx: int = 0) -> int:
        """Blocks no request holds (free or cached) on the replica."""
        return self._replica(replica_idx).pool.num_free

    def total_num_blocks(self, replica_idx: int = 0) -> int:
        """Blocks of the replica's pool."""
        self._replica(replica_idx)
        return self.total_num_pages

    def get_pct_used_blocks_after_allocation(self, ctx: object, replica_idx: int = 0) -> float:
        """Fraction (0..1, capped) of the replica's blocks in use if `ctx` got all
        the pages its tokens need now, ignoring prefix hits; for admission control."""
        data = cache_context(ctx)
        replica = self._replica(replica_idx)
        state = replica.requests.get(data.request_id)
        held = state.num_blocks if state is not None else 0
        needed = max(0, -(-data.current_length // self.page_size) - held)
        used = self.total_num_pages - replica.pool.num_free
        return min(1.0, (used + needed) / self.total_num_pages)

    # ----------------------------------------------------------------- metrics

    def get_metrics_aggregated(self) -> KVCacheMetrics:
        """Metrics summed over replicas."""
        return sum((r.metrics for r in self._replicas), KVCacheMetrics())

    def get_cache_tokens_by_salt(self) -> dict[str | None, int]:
        """Tokens served from cache, summed over replicas, per cache salt (None: unsalted)."""
        out: Counter[str | None] = Counter()
        for replica in self._replicas:
            out.update(replica.cache_tokens_by_salt)
        return dict(out)

    def reset_metrics(self) -> None:
        """Zeroes every replica's metrics and per-salt counts (the tiers'
        counters in `get_tier_metrics` keep counting)."""
        for replica in self._replicas:
            replica.metrics = KVCacheMetrics()
            replica.cache_tokens_by_salt.clear()

    def get_tier_metrics(self) -> dict[str, TierMetrics]:
        """Each lower tier's counters summed over replicas, by tier name."""
        out: dict[str, TierMetrics] = {}
        for replica in self._replicas:
            for connector in replica.connectors:
                out[connector.name] = out.get(connector.name, TierMetrics()) + connector.metrics
        return out

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block no request holds, and every lower tier's
        pages (on a shared disk or remote tier, for every process using it)."""
        for replica in self._replicas:
            replica.reset_prefix_cache()
            self._check(replica)

    # ---------------------------------------------------------------- lifetime

    def flush(self) -> None:
        """Returns once every block saved to a lower tier is stored there
        (written to disk, sent to the remote store), so other processes see it."""
        for replica in self._replicas:
            for connector in replica.connectors:
                connector.flush()

    def shutdown(self) -> None:
        """Finishes every tier's pending copies and writes and releases their
        threads, files and connections. The device cache stays usable; the
        disk and remote tiers do not."""
        for replica in self._replicas:
            replica.shutdown()

    def __enter__(self) -> PagedKVCacheManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ checks

    def _check(self, replica: Replica) -> None:
        if self.enable_runtime_checks:
            replica.check_invariants()


def _as_tree(
    params: KVCacheParams | MultiKVCacheParams,
    per_leaf: dict[str, list[PagedCacheInputs]],
    path: str | None = None,
) -> KVCacheInputs | MultiKVCacheInputs:
    """The per-leaf device inputs (keyed as `params.leaves()` names them)
    arranged in the shape of `params`' tree."""
    if isinstance(params, MultiKVCacheParams):
        return MultiKVCacheInputs(
            {
                name: _as_tree(child, per_leaf, name if path is None else f"{path}.{name}")
                for name, child in params.children.items()
            }
        )
    return KVCacheInputs(per_leaf[path or SINGLE_CACHE])

"""mokv's `PagedKVCacheManager` behind the interface MAX's scheduler drives.

MAX 26.7's serving loop (`max serve`) and `max generate` talk to their cache
through `PagedKVCacheManagerInterface`, one request context per call:

    claim(ctx, replica_idx)  alloc(ctx) -> KVTransfer   runtime_inputs(batches)
    ctx.update(token)        step(ctx)                  release(ctx)

plus occupancy (`block_count`, `pressure_pct`, host / disk bytes), metrics
(`take_metrics_aggregated`), the placement probe
(`get_prefix_cache_hit_counts`) and lifetime calls. `SchedulerKVCacheManager`
implements it by translating each call into mokv's documented API (`claim`,
`alloc`, `runtime_inputs`, `step`, `release` take request ids and per-replica
batches there); it keeps no request state of its own, so the two cannot
disagree:

- `alloc` returns an already complete transfer: a lower tier's hits are
  copied into their pages before mokv's `runtime_inputs` returns, so no
  request needs holding out of a batch. MAX's `InsufficientBlocksError`
  replaces mokv's (the scheduler catches MAX's class to preempt or requeue);
  the request is left as it was, as both managers document. On a request's
  first admission `cached_prefix_external_length` records the tokens the
  lower tiers served (MAX's scheduler exports them as external hits).
- `runtime_inputs` builds mokv's tables and lays them out as MAX's graphs
  take them (`max_inputs`).
- Prefix caching (verified hits), the host / disk / remote tiers, cache
  salts (`ctx.cache_salt`, set by `max serve` from the `X-Cache-Salt` header
  or the `cache_salt` request field), 8-bit KV and replicas are mokv's
  manager's, unchanged.

One cache per manager: MAX's `MultiKVCacheParams` trees are refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from max.driver import Buffer, is_virtual_device_mode
from max.engine import InferenceSession
from max.nn.kv_cache import BatchCharacteristics as MaxBatchCharacteristics
from max.nn.kv_cache import KVCacheParamInterface, MHAKVCacheParams
from max.nn.kv_cache.cache_params import KVCacheBuffer as MaxKVCacheBuffer
from max.nn.kv_cache.cache_params import NullKVConnectorConfig
from max.nn.kv_cache.metrics import KVCacheMetrics as MaxKVCacheMetrics
from max.pipelines.context import TextContext as MaxTextContext
from max.pipelines.kv_cache import BlockCount, ByteCount, PagedKVCacheManagerInterface
from max.pipelines.kv_cache import InsufficientBlocksError as MaxInsufficientBlocksError
from max.pipelines.kv_cache.kv_connector import CompletedTransfer, KVTransfer
from max.pipelines.kv_cache.paged_kv_cache import PrefixCacheHits

from ..contract import KVCacheInputs
from ..paged import BatchCharacteristics, InsufficientBlocksError, PagedKVCacheManager
from ..params import KVCacheParams, from_max
from ..tiers import KVConnectorConfig
from .compile_only import CompileOnlyKVCacheManager
from .max_inputs import MaxDeviceInputs, max_device_inputs
from .max_metrics import CacheCounters, MetricsWindow, cache_counters

if TYPE_CHECKING:
    from .cache_config import MokvCacheConfig


def _check_single_cache(params: object) -> None:
    if not isinstance(params, MHAKVCacheParams):
        raise TypeError(f"params must be MAX's MHAKVCacheParams (one cache per manager), got {type(params).__name__}")


def _without_connector(params: MHAKVCacheParams) -> MHAKVCacheParams:
    """`params` with MAX's KV connector taken off: mokv's tiers (its manager's
    `connector_config` and host pages) stand in for MAX's connector, which
    does not shape the cache."""
    return dataclasses.replace(params, kv_connector_config=NullKVConnectorConfig())


def _converted(params: object) -> KVCacheParams:
    """mokv's params for MAX's `params` of one cache, without MAX's connector."""
    _check_single_cache(params)
    return from_max(_without_connector(params))


logger = logging.getLogger("mokv.pipelines")


class SchedulerKVCacheManager(PagedKVCacheManagerInterface):
    """MAX's scheduler-facing cache manager, backed by a mokv `PagedKVCacheManager`.

    Args:
        params: MAX's cache parameters the model's graph was built with
            (`MHAKVCacheParams`); the scheduler reads them (`page_size`, ...).
        manager: The mokv manager holding the cache; its params must be
            `mokv.from_max(params)`, MAX's KV connector aside (build both
            with `create`, or `create_kv_manager` in a pipeline).

    Raises:
        TypeError: `params` is no `MHAKVCacheParams` or `manager` no mokv
            `PagedKVCacheManager`.
        ValueError: `manager`'s params are not `params` converted.
    """

    def __init__(self, params: KVCacheParamInterface, manager: PagedKVCacheManager) -> None:
        _check_single_cache(params)
        if not isinstance(manager, PagedKVCacheManager):
            raise TypeError(f"manager must be a mokv PagedKVCacheManager, got {type(manager).__name__}")
        expected = from_max(_without_connector(params))
        if manager.params != expected:
            raise ValueError(f"manager serves {manager.params}, but params convert to {expected}")
        self.params = params
        self.manager = manager
        self._replicas = range(manager.num_replicas)
        self._devices = [[ref.to_device() for ref in refs] for refs in expected.devices_per_replica]
        self._has_tiers = any(manager.get_tier_usage(r) for r in self._replicas)
        self._window = MetricsWindow()

    @classmethod
    def create(
        cls,
        params: KVCacheParamInterface,
        session: InferenceSession | None,
        total_num_pages: int,
        *,
        max_batch_size: int,
        total_num_host_pages: int = 0,
        connector_config: KVConnectorConfig | None = None,
        enable_runtime_checks: bool = False,
    ) -> SchedulerKVCacheManager:
        """A mokv manager for MAX's `params` (arguments as `mokv.PagedKVCacheManager`'s), adapted.

        Raises:
            TypeError, ValueError: As `mokv.PagedKVCacheManager` and `from_max`
                (a MAX setting mokv does not support is named).
        """
        manager = PagedKVCacheManager(
            _converted(params),
            session,
            total_num_pages,
            total_num_host_pages,
            enable_runtime_checks,
            max_batch_size=max_batch_size,
            connector_config=connector_config,
        )
        return cls(params, manager)

    # ----------------------------------------------------------------- requests

    def _replica_of(self, ctx: MaxTextContext) -> int:
        """The replica `ctx`'s request is claimed on."""
        request_id = ctx.request_id
        for replica in self._replicas:
            if self.manager.contains(request_id, replica):
                return replica
        raise ValueError(f"request {request_id!r} is not claimed")

    def _per_replica(self, ctx: MaxTextContext) -> list[list[MaxTextContext]]:
        batches: list[list[MaxTextContext]] = [[] for _ in self._replicas]
        batches[self._replica_of(ctx)].append(ctx)
        return batches

    def claim(self, ctx: MaxTextContext, replica_idx: int = 0) -> None:
        """Pins the request to replica `replica_idx` until it is released."""
        self.manager.claim(ctx.request_id, replica_idx)

    def contains(self, ctx: MaxTextContext) -> bool:
        """Whether the request is claimed on any replica."""
        return any(self.manager.contains(ctx.request_id, replica) for replica in self._replicas)

    def alloc(self, ctx: MaxTextContext) -> KVTransfer:
        """Gives the claimed request pages for its next step, prefix hits first.

        Raises:
            max.pipelines.kv_cache.InsufficientBlocksError: Too few free
                pages; the request is left as it was.
            ValueError: The request is not claimed (or a bad context, by name).
        """
        replica = self._replica_of(ctx)
        first_admission = ctx.tokens.processed_length == 0 and ctx.tokens.active_length > 1
        tier_pages = self._tier_pages() if first_admission and self._has_tiers else None
        try:
            self.manager.alloc(ctx, replica)
        except InsufficientBlocksError as error:
            raise MaxInsufficientBlocksError(str(error)) from error
        if tier_pages is not None:
            ctx.cached_prefix_external_length = (self._tier_pages() - tier_pages) * self.params.page_size
        return CompletedTransfer()

    def _tier_pages(self) -> int:
        return sum(tier.hit_pages for tier in self.manager.get_tier_metrics().values())

    def alloc_dummy(self, ctx: MaxTextContext, replica_idx: int = 0) -> None:
        """Claims a padding request whose only page is the replica's null page."""
        self.manager.alloc_dummy(ctx.request_id, replica_idx)

    def step(self, ctx: MaxTextContext) -> None:
        """Commits the request's newly full pages to the prefix cache (after `ctx.update`)."""
        self.manager.step(self._per_replica(ctx))

    def release(self, ctx: MaxTextContext) -> None:
        """Returns the request's pages; its cached ones stay reusable."""
        self.manager.release(ctx.request_id, self._replica_of(ctx))

    def get_req_blocks_per_leaf(self, ctx: MaxTextContext) -> dict[str, list[int]]:
        """The request's page ids, under the one leaf MAX's params name."""
        pages = self.manager.get_req_blocks(ctx.request_id, self._replica_of(ctx))
        return {leaf_id: list(pages) for leaf_id in self.params.leaves()}

    def num_req_blocks(self, ctx: MaxTextContext) -> int:
        """How many pages the request holds."""
        return len(self.manager.get_req_blocks(ctx.request_id, self._replica_of(ctx)))

    def get_prefix_cache_hit_counts(self, ctx: MaxTextContext) -> list[PrefixCacheHits]:
        """Per replica, the leading pages of a new request its device prefix
        cache holds (`PagedKVCacheManager.get_device_prefix_pages`); changes nothing."""
        return [PrefixCacheHits(device_blocks=pages) for pages in self.manager.get_device_prefix_pages(ctx)]

    # ------------------------------------------------------------- graph inputs

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[MaxTextContext]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: MaxBatchCharacteristics | None = None,
    ) -> tuple[MaxDeviceInputs, ...]:
        """The cache's graph inputs for one batch per replica, one
        `KVCacheInputsPerDevice` per (replica, TP shard), replica-major.

        Raises:
            ValueError: As mokv's `runtime_inputs` (a request unclaimed,
                without pages for this step, a batch over the bounds), by name.
        """
        bounds = None
        if batch_characteristics is not None:
            bc = batch_characteristics
            bounds = BatchCharacteristics(bc.batch_size, bc.max_prompt_length, bc.max_cache_valid_length)
        inputs = self.manager.runtime_inputs(batches, max_cache_length=max_cache_length, batch_characteristics=bounds)
        assert isinstance(inputs, KVCacheInputs)
        out: list[MaxDeviceInputs] = []
        for replica, devices in enumerate(self._devices):
            shards = inputs.inputs[replica * len(devices) : (replica + 1) * len(devices)]
            rows = len(batches[replica]) if bounds is None else bounds.batch_size
            out += max_device_inputs(self.params, shards, devices, rows)
        return tuple(out)

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[MaxTextContext]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: MaxBatchCharacteristics | None = None,
    ) -> tuple[MaxDeviceInputs, ...]:
        """`runtime_inputs` (this manager serves one cache, so they are its leaf's)."""
        return self.runtime_inputs(
            batches, max_cache_length=max_cache_length, batch_characteristics=batch_characteristics
        )

    def get_device_buffer(self, replica_idx: int) -> MaxKVCacheBuffer:
        """The replica's page tensors (and scales) as MAX's `KVCacheBuffer`."""
        buffer = self.manager.get_device_buffer(replica_idx)
        (leaf_id,) = self.params.leaves()
        values: list[Buffer] = list(buffer.graph_values)
        return MaxKVCacheBuffer(
            leaf_id=leaf_id,
            replicates_kv_across_tp=buffer.replicates_kv_across_tp,
            values=values,
            scales=None if buffer.scales is None else list(buffer.scales),
        )

    # ------------------------------------------------------------- occupancy

    def block_count(self, replica_idx: int = 0) -> BlockCount:
        """The replica's device pages: free (free or cached, unheld) and total."""
        return BlockCount(
            free=self.manager.num_free_blocks(replica_idx), total=self.manager.total_num_blocks(replica_idx)
        )

    def _tier_bytes(self, name: str) -> ByteCount:
        used = total = 0
        for replica in self._replicas:
            usage = self.manager.get_tier_usage(replica).get(name)
            if usage is not None:
                used += usage.used_bytes
                total += usage.total_bytes
        return ByteCount(free=total - used, total=total)

    def host_byte_count(self) -> ByteCount:
        """The host tiers' bytes, summed over replicas (zero without one)."""
        return self._tier_bytes("host")

    def disk_byte_count(self) -> ByteCount:
        """The disk tier's bytes as this process sees them (zero without one)."""
        return self._tier_bytes("disk")

    @property
    def effective_max_seq_length(self) -> int:
        """The longest request one replica's pages hold."""
        return self.manager.total_num_pages * self.manager.page_size

    # ------------------------------------------------------------- transfers

    def poll_transfers(self) -> None:
        """Nothing to drain: every `alloc` returns a completed transfer."""

    def pending_transfers_exist(self, replica_idx: int = 0) -> bool:
        """False: tier loads land before `runtime_inputs` returns."""
        return False

    # --------------------------------------------------------------- metrics

    def _counters_now(self) -> CacheCounters:
        return cache_counters(
            self.manager.get_metrics_aggregated(), self.manager.get_tier_metrics(), self.manager.page_size
        )

    def get_metrics_aggregated(self) -> MaxKVCacheMetrics:
        """Every replica's figures since the last `take_metrics_aggregated`
        (or the start), as MAX's `KVCacheMetrics`."""
        return self._window.peek(self._counters_now())

    def take_metrics_aggregated(self) -> MaxKVCacheMetrics:
        """`get_metrics_aggregated`, then starts the next window (mokv's own
        counters, `manager.get_metrics_aggregated()`, keep counting)."""
        return self._window.take(self._counters_now())

    # -------------------------------------------------------------- lifetime

    def reset_prefix_cache(self) -> None:
        """Forgets every unheld cached page and every tier's pages."""
        self.manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Lets the tiers finish their writes and release threads and connections."""
        self.manager.shutdown()


def create_kv_manager(
    params: KVCacheParamInterface,
    cache: MokvCacheConfig,
    *,
    max_batch_size: int,
    max_seq_len: int,
    session: InferenceSession,
    available_cache_memory: int,
    max_num_input_tokens: int | None,
) -> SchedulerKVCacheManager | CompileOnlyKVCacheManager:
    """The manager a MAX pipeline builds in place of `load_kv_manager`'s (the
    seam `mokv.pipelines.architecture` calls).
    In compile-only mode (MAX's virtual devices) its settings are checked and a
    `CompileOnlyKVCacheManager` stands in: no device memory exists to hold pages.

    The device pool is sized as MAX's own (non-Jenga) manager sizes it: the
    pages MAX's memory plan left room for (`available_cache_memory //
    bytes_per_page`, less the null page), but no more than a full batch of
    `max_seq_len` requests can hold (`max_batch_size * ceil(max_seq_len /
    page_size)`); any page size (mokv needs no multiple of 128). The tiers
    are `cache`'s. `max_num_input_tokens` sizes nothing here (mokv's pages do
    not depend on the prefill chunk).

    Raises:
        ValueError: The budget holds fewer tokens than one `max_seq_len`
            request (which could then never run); or what
            `SchedulerKVCacheManager.create` refuses.
    """
    page_bytes = cache.params.bytes_per_page
    page_size = cache.params.page_size
    pages_per_request = -(-max_seq_len // page_size)
    total_num_pages = min(available_cache_memory // page_bytes - 1, max_batch_size * pages_per_request)
    if total_num_pages < pages_per_request:
        raise ValueError(
            f"available_cache_memory={available_cache_memory} bytes holds {max(total_num_pages, 0)} pages of "
            f"{page_size} tokens ({page_bytes} bytes each, beside the null page), fewer tokens than "
            f"one request of max_seq_len={max_seq_len}"
        )
    if is_virtual_device_mode():
        compile_only = CompileOnlyKVCacheManager(_converted(params), total_num_pages)
        logger.info("mokv KV cache: compile-only mode, no pages allocated (%d in a real run)", total_num_pages)
        return compile_only
    manager = SchedulerKVCacheManager.create(
        params,
        session,
        total_num_pages,
        max_batch_size=max_batch_size,
        total_num_host_pages=cache.total_num_host_pages(total_num_pages),
        connector_config=cache.connector,
    )
    logger.info(
        "mokv KV cache: %d pages of %d tokens (%d bytes each), %d host pages, tiers: %s",
        total_num_pages,
        cache.params.page_size,
        page_bytes,
        manager.manager.total_num_host_pages,
        ", ".join(manager.manager.get_tier_usage()) or "none",
    )
    return manager

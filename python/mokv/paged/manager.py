"""`PagedKVCacheManager`: routes requests to replicas, validates calls, builds graph inputs.

The lifecycle of a request on replica r (MAX's documented API):

    claim(id, r)          reserve a row for the request
    alloc(ctx, r)         give it pages for its next step (prefix hits first)
    runtime_inputs(...)   graph inputs for a batch of allocated requests
    ctx.update(token)     the model ran; the step's tokens are now cached
    step(batches)         commit newly full pages to the prefix cache
    release(id, r)        give its pages back (cached ones stay reusable)

Contexts may be mokv's `TextContext` or MAX's own (`mokv.context.cache_context`
adapts them; `batch_resolution` resolves them to their requests). Each replica
(`replica.Replica`) has its own page pool, page table and lower tiers (host
memory, disk, remote store: `mokv.tiers`), and holds the per-request policy; a
request lives on one replica from `claim` to `release`. With
`MultiKVCacheParams` every replica allocates one page tensor per leaf cache and
one page id names the same page in all of them, so a claim, an allocation and
a prefix hit cover every cache. Graph inputs are planned (`input_plan`) and
built (`runtime_inputs`) apart; `memory` refuses sizes that would not fit.

Costs: bookkeeping is O(1) per page (the pool is lists and an OrderedDict);
hashing and token checks are numpy over a request's new full pages; a batch's
lookup table is one numpy gather. Nothing loops over tokens in Python.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence

from max.engine import InferenceSession

from ..buffer import KVCacheBuffer
from ..context import CacheContext, TextContext, cache_context
from ..contract import KVCacheInputs, MultiKVCacheInputs
from ..params import AnyKVCacheParams, KVCacheStrategy, MultiKVCacheParams, resolve_params
from ..prefix import PageHasher
from ..tiers import KVConnectorConfig
from ..tiers.config import tier_factory
from ..validation import check_bool, check_int, check_request_id, check_sequence, check_unique
from .batch_resolution import BatchResolver, due_entries
from .input_plan import BatchCharacteristics, plan_tables
from .memory import check_memory
from .page_pool import InsufficientBlocksError
from .queries import PagedCacheQueries
from .replica import Replica
from .reservation import reservation_shortfall
from .runtime_inputs import InputTrees

__all__ = ["InsufficientBlocksError", "PagedKVCacheManager"]


class PagedKVCacheManager(PagedCacheQueries):
    """Paged KV cache manager with data parallelism and optional prefix caching.

    Every public call either does what its docstring says or raises
    `TypeError` / `ValueError` naming the bad argument, having changed nothing
    (calls that take batches check the whole batch first). The one documented
    exception is `alloc`'s `InsufficientBlocksError`, which refreshes the
    recency of the prefix hits it found, as MAX's manager does. The queries
    and metrics are `queries.PagedCacheQueries`'.

    Args:
        params: Cache shape and policy: a `KVCacheParams` (its `cache_strategy`
            must be PAGED), a `MultiKVCacheParams`, or MAX's own
            `MHAKVCacheParams` / `MultiKVCacheParams` (converted by
            `mokv.params.from_max`, which refuses what mokv does not support).
        session: The inference session the cache serves (kept for API parity
            with MAX; buffers are allocated on `params.devices` directly).
        total_num_pages: Device pages per replica for requests; each page
            tensor has one more, the null page (`mokv.contract`).
        total_num_host_pages: Host-tier pages per replica; 0 takes
            `params.num_host_pages` (from `host_kvcache_swap_space_gb`, 0 when
            swapping is off), and no pages disable the tier.
        enable_runtime_checks: Assert the pool invariants after every call.
        max_batch_size: Most requests one replica's batch may hold.

        connector_config: The disk and remote tiers (`KVConnectorConfig`,
            MAX's name); None for none. Call `shutdown()` (or use the manager
            as a context manager) to let their background writes finish.

    Raises:
        TypeError, ValueError: A bad argument, by name; sizes whose memory
            (page tensors, host tier, bookkeeping, the largest runtime
            inputs) would not fit in a device's free memory are refused
            before anything is allocated (`memory.check_memory`).
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
            raise ValueError(f"PagedKVCacheManager needs cache_strategy=PAGED, got {params.cache_strategy.value}")
        if session is not None and not isinstance(session, InferenceSession):
            raise TypeError(f"session must be a max.engine.InferenceSession or None, got {session!r}")
        total_num_pages = check_int("total_num_pages", total_num_pages, minimum=1)
        total_num_host_pages = check_int("total_num_host_pages", total_num_host_pages, minimum=0)
        max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
        check_bool("enable_runtime_checks", enable_runtime_checks)
        total_num_host_pages = total_num_host_pages or params.num_host_pages
        if total_num_host_pages and not params.enable_prefix_caching:
            raise ValueError(
                f"total_num_host_pages={total_num_host_pages} needs enable_prefix_caching=True: "
                "the host tier only keeps prefix-cached pages"
            )
        if connector_config is not None and connector_config.enabled and not params.enable_prefix_caching:
            raise ValueError(
                "the disk and remote tiers of connector_config need enable_prefix_caching=True: "
                "they only keep prefix-cached pages"
            )
        check_memory(params, total_num_pages, total_num_host_pages, max_batch_size)
        self.params = params
        self.session = session
        self.page_size = params.page_size
        self.total_num_pages = total_num_pages
        self.total_num_host_pages = total_num_host_pages
        self.max_batch_size = max_batch_size
        self.enable_runtime_checks = bool(enable_runtime_checks)
        self._hasher = PageHasher(params.page_size)
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
        self._requests = BatchResolver(self._replicas)
        """Which replica holds each request, and the batches resolved lately."""
        self._inputs = InputTrees(params, [(replica.buffers, replica.devices) for replica in self._replicas])

    # ----------------------------------------------------------------- routing

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas, each with its own pool."""
        return len(self._replicas)

    # --------------------------------------------------------------- lifecycle

    def claim(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Reserves a page-table row for `request_id` (a `str` or `int`) on replica `replica_idx`."""
        self._claim(request_id, replica_idx, dummy=False)

    def _claim(self, request_id: Hashable, replica_idx: int, *, dummy: bool) -> None:
        replica = self._requests.replica(replica_idx)
        check_request_id(request_id)
        owner = self._requests.replica_of.get(request_id)
        if owner is not None:
            raise ValueError(f"request {request_id!r} is already claimed on replica {owner.index}")
        replica.claim(request_id, dummy=dummy)
        self._requests.add(request_id, replica)

    def contains(self, request_id: Hashable, replica_idx: int = 0) -> bool:
        """Whether `request_id` is claimed on replica `replica_idx`."""
        replica = self._requests.replica(replica_idx)
        check_request_id(request_id)
        return self._requests.replica_of.get(request_id) is replica

    def alloc_dummy(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Claims a padding request whose only page is the null page."""
        self._claim(request_id, replica_idx, dummy=True)

    def alloc(self, data: object, replica_idx: int = 0, num_steps: int = 1) -> None:
        """Gives a claimed request pages for its next `num_steps` steps.

        `data` is a mokv or MAX `TextContext`. With prefix caching, the longest
        verified run of cached pages (device first, then each lower tier)
        continuing the request's committed pages is reused and `data` skips their tokens
        (on a first admission `data.cached_prefix_length` records how many, as
        MAX's manager does); the last token is never served from cache, since
        the model must run it.

        Raises:
            TypeError, ValueError: A bad argument, by name: an unclaimed or
                dummy request, a context whose tokens differ from the
                request's, a `num_steps` that is no positive integer. Nothing
                has changed.
            InsufficientBlocksError: Too few free pages (or more tokens than a
                replica holds). The request and `data` are left as they were,
                and so is the pool but for one thing, as in MAX's manager: the
                failed allocation still counts as a use of the cached device
                pages it matched, which move to the most-recently-used end of
                the free queue (tail first), so a retry finds the same prefix.
        """
        replicas = self._replicas
        if type(replica_idx) is int and 0 <= replica_idx < len(replicas):
            replica = replicas[replica_idx]
        else:
            replica = self._requests.replica(replica_idx)
        ctx = data if type(data) is TextContext else cache_context(data)
        try:
            state = replica.requests.get(ctx.request_id)
        except TypeError:  # an unhashable request id: `live` names it
            state = None
        if (
            state is not None
            and state.source is data
            and num_steps == 1
            and type(num_steps) is int
            and ctx.current_length == ctx.processed_length + 1 <= state.capacity
        ):
            # The usual decode step: its one token fits in the last page held.
            replica.metrics.input_tokens += 1
            if self.enable_runtime_checks:
                replica.check_invariants()
            return
        if state is None or state.source is not data:
            ctx, state = self._requests.live(data, replica)
        if state.is_dummy:
            raise ValueError(f"request {ctx.request_id!r} is a dummy and holds only the null page")
        if type(num_steps) is not int or num_steps < 1:
            num_steps = check_int("num_steps", num_steps, minimum=1)
        if ctx.processed_length > state.num_pages * self.page_size:
            raise ValueError(
                f"request {ctx.request_id!r} has processed_length {ctx.processed_length} but its "
                f"pages hold only {state.num_pages * self.page_size} tokens: its context ran ahead of its pages"
            )
        replica.alloc(ctx, state, num_steps)
        if state.source is not data:
            state.source, state.context = data, ctx
            self._requests.version += 1
        if self.enable_runtime_checks:
            replica.check_invariants()

    def step(self, batches: Sequence[Sequence[object]]) -> None:
        """Commits each request's newly completed pages to the prefix cache.

        `batches[r]` holds replica r's requests (one batch per replica). A
        completed page whose verified twin is already cached is swapped for
        that twin (dedup) and its own page freed.

        Raises:
            TypeError, ValueError: A bad batch, by name (see `runtime_inputs`),
                or a request whose context processed tokens it holds no pages
                for. Checked for the whole batch before anything is committed.
        """
        self._requests.check_batches(batches, self.max_batch_size)
        work = []
        for replica, batch in zip(self._replicas, batches, strict=True):
            resolved = self._requests.live_batch(batch, replica)
            work.append((replica, batch, resolved, due_entries(resolved.entries, self.page_size)))
        for replica, batch, resolved, due in work:
            if not resolved.known:
                for data, (ctx, state) in zip(batch, resolved.entries, strict=True):
                    if state.source is not data and not state.is_dummy:
                        state.source, state.context = data, ctx
                        self._requests.version += 1
            if due:  # a decode step has none for most requests, often for all
                replica.commit(due)
            self._check(replica)

    def release(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Returns a request's pages; cached ones stay reusable until evicted.

        Pages go back tail first when prefix caching is on, so the shared
        head of a prefix is evicted last.
        """
        replica = self._requests.claimed_on(request_id, replica_idx)
        replica.release(request_id)
        self._requests.remove(request_id)
        self._check(replica)

    @contextlib.contextmanager
    def reserve(self, replica_batches: Sequence[Sequence[object]]) -> Iterator[None]:
        """Claims and allocates `replica_batches[r]` on replica r for the scope, then releases them.

        For throwaway flows such as warm-up. It grants exactly what `claim` and
        `alloc` of each request in turn would, prefix hits included, and
        everything is checked before the first claim, so a refused
        reservation changes nothing: one batch per replica, unclaimed
        requests, none twice, and, replayed in order on each replica without
        changing it (`reservation.reservation_shortfall`), enough free pages for every
        request once its device prefix hits are counted.

        Raises:
            TypeError, ValueError: A bad batch or request, by name.
            InsufficientBlocksError: A replica has too few free pages (the
                message names the first request that would not fit).
        """
        check_sequence("replica_batches", replica_batches)
        if len(replica_batches) != len(self._replicas):
            raise ValueError(f"expected one batch per replica ({len(self._replicas)}), got {len(replica_batches)}")
        planned: list[tuple[object, Hashable, int]] = []
        contexts: list[list[CacheContext]] = []
        for replica, batch in zip(self._replicas, replica_batches, strict=True):
            check_sequence(f"replica_batches[{replica.index}]", batch)
            contexts.append([])
            for data in batch:
                ctx = cache_context(data)
                request_id = ctx.request_id
                check_request_id(request_id)
                owner = self._requests.replica_of.get(request_id)
                if owner is not None:
                    raise ValueError(f"request {request_id!r} is already claimed on replica {owner.index}")
                if ctx.processed_length:
                    raise ValueError(
                        f"request {request_id!r} has processed_length {ctx.processed_length}: a reserved "
                        "request is new, with nothing in the cache yet"
                    )
                planned.append((data, request_id, replica.index))
                contexts[-1].append(ctx)
        check_unique("request", (request_id for _, request_id, _ in planned))
        for replica, replica_contexts in zip(self._replicas, contexts, strict=True):
            shortfall = reservation_shortfall(replica, replica_contexts)
            if shortfall is not None:
                raise InsufficientBlocksError(f"reserve refused: {shortfall}")
        claimed: list[tuple[Hashable, int]] = []
        try:
            for data, request_id, replica_idx in planned:
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
            TypeError, ValueError: Checked for the whole call before anything is
                built: not one batch per replica, a batch over
                `max_batch_size`, a request unclaimed, on another replica, twice
                in the batch or without pages for this step (call `alloc`
                first), or a bad `num_steps` / `max_cache_length` /
                `batch_characteristics`, each named.
        """
        self._requests.check_batches(batches, self.max_batch_size)
        capacity = self.total_num_pages * self.page_size
        if type(num_steps) is not int or not 1 <= num_steps <= capacity:
            num_steps = check_int("num_steps", num_steps, minimum=1, maximum=capacity)
        if max_cache_length is not None:
            max_cache_length = check_int("max_cache_length", max_cache_length, minimum=1, maximum=capacity)
        if batch_characteristics is not None and not isinstance(batch_characteristics, BatchCharacteristics):
            raise TypeError(
                f"batch_characteristics must be a BatchCharacteristics or None, got {batch_characteristics!r}"
            )
        # Plain loops: a comprehension costs a function call per use (Python 3.11).
        plans = []
        ps = self.page_size
        for replica, batch in zip(self._replicas, batches, strict=True):
            resolved = self._requests.live_batch(batch, replica)
            plans.append(
                plan_tables(resolved.entries, resolved.rows, ps, num_steps, max_cache_length, batch_characteristics)
            )
        built = []  # nothing is written until every replica's batch passed
        for replica, plan in zip(self._replicas, plans, strict=True):
            built.append(replica.staging.build(replica.table, plan))
        inputs = self._inputs.tree(tuple(built))
        for replica in self._replicas:
            replica.wait_for_loads()  # pages loaded from a tier hold their bytes before the graph runs
        return inputs

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

    # ---------------------------------------------------------------- lifetime

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page no request holds, and every lower tier's
        pages (on a shared disk or remote tier, for every process using it)."""
        for replica in self._replicas:
            replica.reset_prefix_cache()
            self._check(replica)

    def flush(self) -> None:
        """Returns once every page saved to a lower tier is stored there
        (written to disk, sent to the remote store), so other processes see it."""
        for replica in self._replicas:
            for tier in replica.tiers:
                tier.flush()

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

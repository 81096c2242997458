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
from dataclasses import dataclass
from operator import is_

from max.driver import CPU, Device
from max.engine import InferenceSession

from ..buffer import KVCacheBuffer
from ..connectors.base import TierMetrics, TierUsage
from ..connectors.config import KVConnectorConfig, tier_factory
from ..context import CacheContext, TextContext, cache_context, check_same_tokens
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
from ..validation import check_bool, check_fits, check_int, check_request_id, check_sequence, check_unique
from .block_pool import NO_UID
from .hashing import BlockHasher, salted_root
from .replica import InsufficientBlocksError, Replica, RequestState
from .runtime_inputs import BatchCharacteristics, BatchTables, TableRows, device_inputs, table_rows

__all__ = ["InsufficientBlocksError", "PagedKVCacheManager"]


@dataclass(eq=False, slots=True)
class _ResolvedBatch:
    """One replica's batch with each entry's context and request state."""

    version: int
    """The manager's requests version it was resolved at."""
    objects: list[object]
    """The context objects passed, in order."""
    entries: list[tuple[CacheContext, RequestState]]
    known: bool
    """Whether each context object is the one last passed for its request (else
    `step` records the new ones)."""
    rows: TableRows
    """The entries' block-table rows."""


class PagedKVCacheManager:
    """Paged KV cache manager with data parallelism and optional prefix caching.

    Every public call either does what its docstring says or raises
    `TypeError` / `ValueError` naming the bad argument, having changed nothing
    (calls that take batches check the whole batch first). The one documented
    exception is `alloc`'s `InsufficientBlocksError`, which refreshes the
    recency of the prefix hits it found, as MAX's manager does.

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
        max_batch_size: Most requests one replica's batch may hold.

        connector_config: The disk and remote tiers (`KVConnectorConfig`);
            None for none. Call `shutdown()` (or use the manager as a context
            manager) to let their background writes finish.

    Raises:
        TypeError, ValueError: A bad argument, by name; sizes whose memory
            (block tensors, host tier, bookkeeping, the largest runtime
            inputs) would not fit in a device's free memory are refused
            before anything is allocated.
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
                "the host tier only keeps prefix-cached blocks"
            )
        if connector_config is not None and connector_config.enabled and not params.enable_prefix_caching:
            raise ValueError(
                "the disk and remote tiers of connector_config need enable_prefix_caching=True: "
                "they only keep prefix-cached blocks"
            )
        _check_memory(params, total_num_pages, total_num_host_pages, max_batch_size)
        self.params = params
        self.session = session
        self.page_size = params.page_size
        self.total_num_pages = total_num_pages
        self.total_num_host_pages = total_num_host_pages
        self.max_batch_size = max_batch_size
        self.enable_runtime_checks = bool(enable_runtime_checks)
        self._hasher = BlockHasher(params.page_size)
        leaves = params.leaves()
        tiers = tier_factory(params, total_num_pages, total_num_host_pages, connector_config)
        self._leaf_names = list(leaves)
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
        self._requests_version = 0
        """Bumped whenever a request is claimed or released or takes a new context
        object: what a remembered batch resolution (`_live_batch`) depends on."""
        self._all_on_host = all(device.is_host for replica in self._replicas for device in replica.devices)
        self._host_inputs: dict[tuple[BatchTables, ...], KVCacheInputs | MultiKVCacheInputs] = {}
        """With every device on the host, the inputs returned for each tuple of
        per-replica tables (refilled in place, the same objects for the same
        arrays and shapes), so a steady loop builds no new input objects."""
        self._resolved: list[_ResolvedBatch | None] = [None for _ in self._replicas]
        """Per replica, the last batch resolved on the fast path. A serving loop
        passes the same batch to `runtime_inputs`, `step` and again next step."""

    # ----------------------------------------------------------------- routing

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas, each with its own pool."""
        return len(self._replicas)

    def _replica(self, replica_idx: int) -> Replica:
        if type(replica_idx) is not int:
            replica_idx = check_int("replica_idx", replica_idx)
        if not 0 <= replica_idx < len(self._replicas):
            raise ValueError(f"replica_idx={replica_idx} is out of range: there are {len(self._replicas)} replicas")
        return self._replicas[replica_idx]

    def _claimed_on(self, request_id: Hashable, replica_idx: int) -> Replica:
        """The replica holding `request_id`, which must be `replica_idx`."""
        replica = self._replica(replica_idx)
        check_request_id(request_id)
        owner = self._replica_of.get(request_id)
        if owner is not replica:
            where = "not claimed" if owner is None else f"claimed on replica {owner.index}"
            raise ValueError(f"request {request_id!r} is {where}, not on replica {replica_idx}")
        return replica

    def _live(self, data: object, replica: Replica) -> tuple[CacheContext, RequestState]:
        """`data` as a context of a request claimed on `replica`, and its state.

        A context object other than the one last passed for the request is
        accepted only if its tokens agree with that one's wherever both have
        tokens (a copy, or the same request seen later); it then replaces it.
        """
        ctx = data if type(data) is TextContext else cache_context(data)
        request_id = ctx.request_id
        if type(request_id) is not str and type(request_id) is not int:
            check_request_id(request_id)
        state = replica.requests.get(request_id)
        if state is None:
            owner = self._replica_of.get(request_id)
            where = "not claimed" if owner is None else f"claimed on replica {owner.index}"
            raise ValueError(f"request {request_id!r} is {where}, not on replica {replica.index}")
        if state.source is not data and not state.is_dummy:
            check_same_tokens(state.context, ctx)
        return ctx, state

    def _checked_batches(self, batches: Sequence[Sequence[object]]) -> None:
        """One batch per replica, each a list of at most `max_batch_size` entries."""
        if type(batches) is not list and type(batches) is not tuple:
            check_sequence("batches", batches)
        if len(batches) != len(self._replicas):
            raise ValueError(f"expected one batch per replica ({len(self._replicas)}), got {len(batches)}")
        for replica, batch in zip(self._replicas, batches, strict=True):
            if type(batch) is not list and type(batch) is not tuple:
                check_sequence(f"batches[{replica.index}]", batch)
            if len(batch) > self.max_batch_size:
                raise ValueError(
                    f"replica {replica.index} batch has {len(batch)} requests, max_batch_size is {self.max_batch_size}"
                )

    def _due_entries(self, entries: list[tuple[CacheContext, RequestState]]) -> list[tuple[CacheContext, RequestState]]:
        """The entries of a replica's batch with newly full blocks to commit.

        Checks each request first: no token processed without a page for it.
        A decode step commits nothing for most requests, so the common case is
        one comparison per request (`RequestState.due_at`); only a request at
        a block boundary (or a refused one) looks further.
        """
        ps = self.page_size
        due = [(ctx, state) for ctx, state in entries if ctx.processed_length >= state.due_at]
        for ctx, state in due:
            if ctx.processed_length > state.num_blocks * ps and not state.is_dummy:
                raise ValueError(
                    f"request {ctx.request_id!r} has processed_length {ctx.processed_length} but "
                    f"its pages hold only {state.num_blocks * ps} tokens: call alloc before running it"
                )
        if due:
            due = [(ctx, state) for ctx, state in due if not state.is_dummy and not state.chain_broken]
        return due

    def _live_batch(self, batch: Sequence[object], replica: Replica) -> _ResolvedBatch:
        """`_live` for each entry of one replica's batch, none twice. The common
        case (a mokv `TextContext` passed before) takes a few operations; anything
        else goes through `_live`, which raises with the reason or accepts it.

        The same objects as last time, with no request claimed, released or
        given a new context object since, resolve as last time (the caller must
        not modify the result)."""
        resolved = self._resolved[replica.index]
        if (
            resolved is not None
            and resolved.version == self._requests_version
            and len(batch) == len(resolved.objects)
            and all(map(is_, batch, resolved.objects))
        ):
            return resolved
        get = replica.requests.get
        entries = []
        all_known = True
        try:
            for data in batch:
                ctx = data if type(data) is TextContext else cache_context(data)
                state = get(ctx.request_id)
                if state is None or state.source is not data:
                    ctx, state = self._live(data, replica)
                    all_known = False
                entries.append((ctx, state))
        except TypeError:
            for data in batch:  # an unhashable request id: name it
                self._live(data, replica)
            raise
        if len({id(state) for _, state in entries}) != len(entries):
            check_unique("request", (ctx.request_id for ctx, _ in entries))
        rows = table_rows([state.row for _, state in entries])
        resolved = _ResolvedBatch(self._requests_version, list(batch), entries, all_known, rows)
        if all_known:  # the entries stay these objects' states until the version moves
            self._resolved[replica.index] = resolved
        return resolved

    # --------------------------------------------------------------- lifecycle

    def claim(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Reserves a slot for `request_id` (a `str` or `int`) on replica `replica_idx`."""
        self._claim(request_id, replica_idx, dummy=False)

    def _claim(self, request_id: Hashable, replica_idx: int, *, dummy: bool) -> None:
        replica = self._replica(replica_idx)
        check_request_id(request_id)
        owner = self._replica_of.get(request_id)
        if owner is not None:
            raise ValueError(f"request {request_id!r} is already claimed on replica {owner.index}")
        replica.claim(request_id, dummy=dummy)
        self._replica_of[request_id] = replica
        self._requests_version += 1

    def contains(self, request_id: Hashable, replica_idx: int = 0) -> bool:
        """Whether `request_id` is claimed on replica `replica_idx`."""
        replica = self._replica(replica_idx)
        check_request_id(request_id)
        return self._replica_of.get(request_id) is replica

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
            TypeError, ValueError: A bad argument, by name: an unclaimed or
                dummy request, a context whose tokens differ from the
                request's, a `num_steps` that is no positive integer. Nothing
                has changed.
            InsufficientBlocksError: Too few free blocks (or more tokens than a
                replica holds). The request and `data` are left as they were,
                and so is the pool but for one thing, as in MAX's manager: the
                failed allocation still counts as a use of the cached device
                blocks it matched, which move to the most-recently-used end of
                the free queue (tail first), so a retry finds the same prefix.
        """
        replicas = self._replicas
        if type(replica_idx) is int and 0 <= replica_idx < len(replicas):
            replica = replicas[replica_idx]
        else:
            replica = self._replica(replica_idx)
        ctx = data if type(data) is TextContext else cache_context(data)
        try:
            state = replica.requests.get(ctx.request_id)
        except TypeError:  # an unhashable request id: `_live` names it
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
            ctx, state = self._live(data, replica)
        if state.is_dummy:
            raise ValueError(f"request {ctx.request_id!r} is a dummy and holds only the null page")
        if type(num_steps) is not int or num_steps < 1:
            num_steps = check_int("num_steps", num_steps, minimum=1)
        if ctx.processed_length > state.num_blocks * self.page_size:
            raise ValueError(
                f"request {ctx.request_id!r} has processed_length {ctx.processed_length} but its "
                f"pages hold only {state.num_blocks * self.page_size} tokens: its context ran ahead of its pages"
            )
        replica.alloc(ctx, state, num_steps)
        if state.source is not data:
            state.source, state.context = data, ctx
            self._requests_version += 1
        if self.enable_runtime_checks:
            replica.check_invariants()

    def step(self, batches: Sequence[Sequence[object]]) -> None:
        """Commits each request's newly completed blocks to the prefix cache.

        `batches[r]` holds replica r's requests (one batch per replica). A
        completed block whose verified twin is already cached is swapped for
        that twin (dedup) and its own block freed.

        Raises:
            TypeError, ValueError: A bad batch, by name (see `runtime_inputs`),
                or a request whose context processed tokens it holds no pages
                for. Checked for the whole batch before anything is committed.
        """
        self._checked_batches(batches)
        work = []
        for replica, batch in zip(self._replicas, batches, strict=True):
            resolved = self._live_batch(batch, replica)
            work.append((replica, batch, resolved, self._due_entries(resolved.entries)))
        for replica, batch, resolved, due in work:
            if not resolved.known:
                for data, (ctx, state) in zip(batch, resolved.entries, strict=True):
                    if state.source is not data and not state.is_dummy:
                        state.source, state.context = data, ctx
                        self._requests_version += 1
            replica.commit(due)
            self._check(replica)

    def release(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Returns a request's pages; cached ones stay reusable until evicted.

        Blocks go back tail first when prefix caching is on, so the shared
        head of a prefix is evicted last.
        """
        replica = self._claimed_on(request_id, replica_idx)
        replica.release(request_id)
        del self._replica_of[request_id]
        self._requests_version += 1
        self._check(replica)

    @contextlib.contextmanager
    def reserve(self, replica_batches: Sequence[Sequence[object]]) -> Iterator[None]:
        """Claims and allocates `replica_batches[r]` on replica r for the scope, then releases them.

        For throwaway flows such as warm-up. It grants exactly what `claim` and
        `alloc` of each request in turn would, prefix hits included, and
        everything is checked before the first claim, so a refused
        reservation changes nothing: one batch per replica, unclaimed
        requests, none twice, and, replayed in order on each replica without
        changing it (`_reservation_shortfall`), enough free pages for every
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
                owner = self._replica_of.get(request_id)
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
            shortfall = _reservation_shortfall(replica, replica_contexts)
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
        self._checked_batches(batches)
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
        for replica, batch in zip(self._replicas, batches, strict=True):
            plans.append(self._plan_tables(replica, batch, num_steps, max_cache_length, batch_characteristics))
        built = []
        for replica, plan in zip(self._replicas, plans, strict=True):
            built.append(replica.staging.build(replica.table, *plan))
        tables = tuple(built)
        inputs = self._host_inputs.get(tables)
        if inputs is None:
            per_leaf: dict[str, list[PagedCacheInputs]] = {name: [] for name in self._leaf_names}
            for replica, replica_tables in zip(self._replicas, tables, strict=True):
                for name, buffer in replica.buffers.items():
                    per_leaf[name] += device_inputs(replica_tables, buffer, replica.devices)
            inputs = _as_tree(self.params, per_leaf)
            if self._all_on_host:
                if len(self._host_inputs) >= _MAX_REMEMBERED_INPUTS:
                    self._host_inputs.clear()
                self._host_inputs[tables] = inputs
        for replica in self._replicas:
            replica.wait_for_loads()  # blocks loaded from a tier hold their bytes before the graph runs
        return inputs

    def _plan_tables(
        self,
        replica: Replica,
        batch: Sequence[object],
        num_steps: int,
        max_cache_length: int | None,
        batch_characteristics: BatchCharacteristics | None,
    ) -> tuple[TableRows, list[int], list[int] | None, int, int, int, int]:
        """One pass over a replica's batch: checks each request (claimed here,
        not twice, pages for this step) while collecting its cache length and
        the batch's maxima. Returns `InputStaging.build`'s
        arguments; nothing is written until every replica's batch passed."""
        ps = self.page_size
        extra = num_steps - 1  # tokens written by the steps after the first
        round_up = extra + ps - 1
        resolved = self._live_batch(batch, replica)
        lengths: list[int] = []
        held_more = False
        max_new = max_context = 0
        for ctx, state in resolved.entries:
            processed = ctx.processed_length
            current = ctx.current_length
            need = (current + round_up) // ps
            held = state.num_blocks
            if held != need and not state.is_dummy:  # a dummy's row is null pages whatever its length
                if held < need:
                    raise ValueError(
                        f"request {ctx.request_id!r} holds {held} pages but needs {need} for "
                        f"{current + extra} tokens: call alloc first"
                    )
                held_more = True
            lengths.append(processed)
            if current > max_context:
                max_context = current
            if current - processed > max_new:
                max_new = current - processed
        width = (max_context + round_up) // ps if lengths else 0
        if max_cache_length is not None:
            fixed = -(-max_cache_length // ps)
            if fixed < width:
                raise ValueError(
                    f"max_cache_length={max_cache_length} gives {fixed} pages, but the batch needs {width}"
                )
            width = fixed
        if batch_characteristics is not None:
            bc = batch_characteristics
            batch_size = len(lengths)
            if batch_size > bc.batch_size or max_new > bc.max_prompt_length or max_context > bc.max_cache_valid_length:
                raise ValueError(f"batch (size {batch_size}, {max_new} new tokens, context {max_context}) exceeds {bc}")
            max_new, max_context = bc.max_prompt_length, bc.max_cache_valid_length
        needs = [(ctx.current_length + round_up) // ps for ctx, _ in resolved.entries] if held_more else None
        return resolved.rows, lengths, needs, width, max_new, max_context, num_steps

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
        """The replica's block tensors (one per TP shard, with their scales
        tensors when quantized); for a `MultiKVCacheParams`, one
        `KVCacheBuffer` per leaf cache by name."""
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
        check_request_id(data.request_id)
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


def device_prefix_hits(replica: Replica, ctx: CacheContext) -> list[int]:
    """The cached device pages `alloc` would reuse for `ctx` as a new request
    on `replica` now, read without changing anything (no request state, no
    tier lookup): the verified run of committed pages continuing the chain of
    its full pages before its last token, rooted in its cache salt. Empty
    without prefix caching, for a context that processed tokens already, and
    for a salt the replica has never cached a page under."""
    ps = replica.page_size
    hashable = (ctx.current_length - 1) // ps
    if not replica.prefix_caching or hashable < 1 or ctx.processed_length:
        return []
    parent_uid: int | None = NO_UID
    root_hash = None
    if ctx.cache_salt is not None:
        parent_uid = replica._salt_uids.get(ctx.cache_salt)
        root_hash = salted_root(ctx.cache_salt)
    if parent_uid is None:
        return []
    tokens = ctx.tokens[: hashable * ps]
    return replica.pool.index.match(
        replica.hasher.hash_blocks(tokens, root_hash), parent_uid, tokens.reshape(hashable, ps)
    )


def _reservation_shortfall(replica: Replica, contexts: Sequence[CacheContext]) -> str | None:
    """Replays `claim` + `alloc` of new requests' `contexts`, in order, on
    `replica` without changing it; returns why the first one that would not
    fit does not, or None when all fit.

    Each request takes the device prefix hits `Replica.alloc` would find,
    cut at the first cached page an earlier request of the replay took from
    the free queue (which evicts it), and fresh pages from the front of the
    free queue, past the pages taken before it. Lower tiers are not asked
    (their hits need fresh pages like misses); that a tier hit loaded for one
    request would be a device hit for a later one is not replayed, so a
    batch repeating a prefix only a lower tier holds may be refused where
    claim + alloc would just fit, never the reverse.
    """
    ps = replica.page_size
    pool = replica.pool
    queue = pool.free_order()
    taken: set[int] = set()  # pages off the free queue in the replay: unheld hits and pages handed out
    evicted: set[int] = set()
    front = 0  # every page of `queue` before it is in `taken`
    capacity = replica.total_num_pages * ps
    for ctx in contexts:
        if ctx.current_length > capacity:
            return (
                f"request {ctx.request_id!r} needs {ctx.current_length} tokens of KV but replica "
                f"{replica.index} holds only {capacity} ({replica.total_num_pages} pages of {ps} tokens)"
            )
        hits = device_prefix_hits(replica, ctx) if ctx.active_length > 1 else []
        cut = next((i for i, page in enumerate(hits) if page in evicted), len(hits))
        del hits[cut:]
        needed = -(-ctx.current_length // ps)
        new = max(0, needed - len(hits))
        unheld = [page for page in hits if not pool.ref_count[page] and page not in taken]
        free = len(queue) - len(taken) - len(unheld)
        if new > free:
            return (
                f"request {ctx.request_id!r} needs {new} new pages on replica {replica.index} "
                f"({len(hits)} of its {needed} are prefix hits) but only {free} are free"
            )
        taken.update(unheld)
        while new:
            page = queue[front]
            front += 1
            if page not in taken:
                taken.add(page)
                if pool.index.is_committed(page):
                    evicted.add(page)
                new -= 1
    return None


_MAX_REMEMBERED_INPUTS = 128
"""Input trees `runtime_inputs` keeps for reuse (one per table shape seen lately)."""

_BOOKKEEPING_BYTES_PER_SLOT = 96
"""Python-side bytes per device or host page besides its tokens (list entries, ints)."""


def _check_memory(
    params: AnyKVCacheParams, total_num_pages: int, total_num_host_pages: int, max_batch_size: int
) -> None:
    """Refuses sizes whose memory would not fit, before anything is allocated.

    Each size is checked alone first, so the message names the one at fault:
    `total_num_pages` sizes every device's block tensors (and the host-side
    index of each replica), `total_num_host_pages` the host tier, and
    `max_batch_size` the largest runtime inputs (a lookup table row per
    request, as wide as the pool, double-buffered) and the block table.
    """
    leaves = params.leaves().values()
    page_bytes = sum(leaf.bytes_per_page for leaf in leaves)
    replicas = params.devices_per_replica
    index_bytes = params.page_size * 8 + _BOOKKEEPING_BYTES_PER_SLOT
    cpu = CPU()
    device_bytes: Counter[Device] = Counter()
    for refs in replicas:
        for ref in refs:
            device_bytes[ref.to_device()] += (total_num_pages + 1) * page_bytes
    host = {
        f"total_num_pages={total_num_pages}": len(replicas) * total_num_pages * index_bytes,
        f"total_num_host_pages={total_num_host_pages}": len(replicas)
        * total_num_host_pages
        * (page_bytes * params.tensor_parallel_degree + index_bytes),
        f"max_batch_size={max_batch_size}": len(replicas) * max_batch_size * (2 * (total_num_pages + 2) + 64) * 4,
    }
    for device, nbytes in device_bytes.items():
        check_fits(f"total_num_pages={total_num_pages} (block tensors)", nbytes, device)
    for what, nbytes in host.items():
        check_fits(what, nbytes, cpu)
    device_bytes[cpu] += sum(host.values())
    for device, nbytes in device_bytes.items():
        check_fits(", ".join(host), nbytes, device)

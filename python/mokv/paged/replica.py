"""One data-parallel replica's policy: which pages its requests hold, and when
cached pages are reused, committed and given back.

A replica owns a block pool (block ids are the same in every cache of a
`MultiKVCacheParams`), a block table (one null-padded row of page ids per
request) and the connectors of its lower tiers (`mokv.connectors`: host
memory, disk, remote store), which it talks to only through the
`KVConnector` interface. The manager routes each call here after validating
it; nothing here knows about other replicas.

Prefix caching, in the life of one request:

* `alloc` looks up the longest verified run of cached blocks continuing the
  request's committed blocks: on the device first, then on each tier in
  order, each continuing where the previous one stopped. It takes the device
  hits, moves the context's window past all hits' tokens, and hands out fresh
  blocks for the rest, loading the tiers' hits into the first of them.
* `commit` (from the manager's `step`) offers each newly full block to the
  prefix cache; a block whose verified twin is already cached is swapped for
  the twin (dedup) and freed. Newly cached blocks are saved to the
  write-through tiers (disk, remote); the host tier takes blocks as the pool
  evicts them.
* `release` frees the request's blocks tail first, so a shared prefix's head
  outlives its tails in the LRU free queue.

Chains: on the device and host tiers a hit's parent is checked by `uid`
(unique per committed block in this process); the disk and remote tiers are
shared between processes, so they check a block's cryptographic chained key
(`mokv.connectors.keys`), its parent's key and its tokens instead.

Cache salt: a request's salt starts its chain at a root of its own on every
tier: its first block's parent hash (`hashing.salted_root`), its first
block's parent uid (a negative uid per salt, where unsalted requests have
`NO_UID`) and its root key. Requests with different salts therefore never
share a block, even when their hashes collide: the parent uid check (device,
host) and the parent key check (disk, remote) tell them apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt
from max.driver import Device

from ..buffer import KVCacheBuffer
from ..connectors.base import BlockToSave, KVConnector, PrefixQuery, SavePoint
from ..connectors.config import TierFactory
from ..context import CacheContext
from ..metrics import KVCacheMetrics
from .block_pool import NO_UID, BlockPool
from .hashing import BlockHasher, salted_root
from .runtime_inputs import BlockTable, InputStaging


class InsufficientBlocksError(RuntimeError):
    """There are not enough free blocks for an allocation; nothing was changed."""


@dataclass(eq=False, slots=True)
class RequestState:
    """What a replica tracks for one claimed request."""

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
    keys: list[bytes] = field(default_factory=list)
    """Cross-process chained key of each hashed block (only when a tier needs them)."""
    root_key: bytes = b""
    """The key before the request's first block (it commits to the cache salt)."""
    root_hash: int | None = None
    """Parent hash of the request's first block: None (the hasher's root) unless salted."""
    source: object = None
    """The context object the caller last passed for the request (identity check)."""
    context: CacheContext | None = None
    """`source` adapted: the tokens a second context object must agree with."""
    due_at: int = 1
    """The `processed_length` from which `step` looks at the request: its next
    block to commit is full, or the context ran past its pages (so `step`
    scans a batch with one comparison per request)."""
    capacity: int = 0
    """Tokens the request's pages hold; -1 for a dummy (so the manager's
    decode `alloc` checks a request with one comparison). `Replica.refresh`
    keeps both marks."""


@dataclass(eq=False, slots=True)
class PrefixHits:
    """What `alloc` found cached for a request's next blocks."""

    device: list[int]
    """Device blocks, in order."""
    tiers: list[tuple[KVConnector, Sequence[object]]]
    """Then each tier's hits, continuing the chain, in lookup order."""
    tokens: npt.NDArray[np.int64]
    """Tokens of every looked-up block, `[blocks, page_size]`."""

    @property
    def num_tier_hits(self) -> int:
        return sum(len(hits) for _, hits in self.tiers)


NO_HITS = PrefixHits([], [], np.zeros((0, 0), np.int64))


Run = tuple[RequestState, int, int, int]
"""A request's blocks to commit in `Replica.commit`: its state, its first
and one-past-last block, and the row of the batch's tokens holding the first."""


class Replica:
    """One replica's memory and request policy.

    Args:
        index: The replica's index (for error messages).
        total_num_pages: Device pages for requests (the null page is extra).
        tiers: Builds the replica's connectors (`mokv.connectors.config`).
        page_size: Tokens per page.
        prefix_caching: Whether full blocks are committed and reused.
        max_batch_size: Initial rows of the block table.
        devices: The replica's TP devices.
        buffers: One `KVCacheBuffer` per leaf cache, by leaf name.
        hasher: The manager's block hasher.
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
        hasher: BlockHasher,
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
        self._salt_uids: dict[str, int] = {}
        self.requests: dict[Hashable, RequestState] = {}
        self.pool = BlockPool(total_num_pages, page_size)
        memory = [unit for buffer in buffers.values() for unit in buffer.to_memory()]
        built = tiers(memory, self.pool.index)
        self.connectors = built.connectors
        self.keyer = built.keyer
        self.host = built.host
        self._evict_tiers = [c for c in self.connectors if c.saves_on is SavePoint.EVICT]
        self._commit_tiers = [c for c in self.connectors if c.saves_on is SavePoint.COMMIT]
        if self._evict_tiers:
            self.pool.on_evict = self._offload
        self.table = BlockTable(null_page=total_num_pages, initial_rows=max_batch_size)
        self.staging = InputStaging(null_page=total_num_pages)

    # ------------------------------------------------------------ tier seam

    def _offload(self, block: int) -> None:
        """The pool is about to hand out cached `block`: victim tiers copy it first."""
        item = [BlockToSave(block)]
        for connector in self._evict_tiers:
            self.metrics.d2h_blocks_copied += connector.save(item)

    def _save_through(self, items: list[BlockToSave], source: KVConnector | None = None) -> None:
        """Newly cached blocks go to every write-through tier but the one they came from."""
        for connector in self._commit_tiers:
            if connector is not source:
                self.metrics.d2h_blocks_copied += connector.save(items)

    def _save_item(self, state: RequestState, i: int, block: int, tokens: npt.NDArray[np.int64]) -> BlockToSave:
        parent_key = state.keys[i - 1] if i else state.root_key
        return BlockToSave(block, state.keys[i], parent_key, tokens)

    def wait_for_loads(self) -> None:
        """Returns once every tier's loads into device blocks have landed."""
        for connector in self.connectors:
            connector.sync()

    # ---------------------------------------------------------------- lifecycle

    def claim(self, request_id: Hashable, *, dummy: bool = False) -> None:
        """Gives `request_id` a table row; a dummy holds only the null page."""
        state = RequestState(self.table.add_row())
        if dummy:
            state.num_blocks = 1  # table rows start out null
            state.is_dummy = True
        self.refresh(state)
        self.requests[request_id] = state

    def refresh(self, state: RequestState) -> None:
        """Sets `state.due_at` and `state.capacity` from its pages and committed blocks."""
        state.capacity = -1 if state.is_dummy else state.num_blocks * self.page_size
        past_pages = state.num_blocks * self.page_size + 1
        next_full = (state.num_committed + 1) * self.page_size
        state.due_at = next_full if self.prefix_caching and next_full < past_pages else past_pages

    def blocks_of(self, request_id: Hashable) -> list[int]:
        """The request's page ids, in token order."""
        state = self.requests[request_id]
        return self.table.read(state.row, 0, state.num_blocks)

    def alloc(self, ctx: CacheContext, state: RequestState, num_steps: int) -> None:
        """Gives the request pages for its next `num_steps` steps (see the module
        docstring).

        On `InsufficientBlocksError` only one thing has changed, as in MAX's
        manager: the cached device blocks the request matched count as used,
        so the unheld ones move to the most-recently-used end of the free
        queue (tail first, like a release), and a retry finds them again.
        """
        ps = self.page_size
        seq_len = ctx.current_length + num_steps - 1
        num_new = -(-seq_len // ps) - state.num_blocks
        active = ctx.active_length
        if active == 1 and (num_new <= 0 or (num_new == 1 and self.pool.num_free)):
            # Decode: no prefix lookup (the last token is never served from
            # cache), at most one new page and one to give.
            if num_new == 1:
                (block,) = self.pool.allocate(1)
                self.table.set(state.row, state.num_blocks, block)
                state.num_blocks += 1
                self.refresh(state)
            self.metrics.input_tokens += 1
            return
        looks_up = self.prefix_caching and active > 1
        first_admission = ctx.processed_length == 0
        hits = self._find_prefix_hits(state, ctx) if looks_up else NO_HITS
        hit_tokens = 0
        try:
            if seq_len > self.total_num_pages * ps:
                raise InsufficientBlocksError(
                    f"request {ctx.request_id!r} needs {seq_len} tokens of KV (current_length "
                    f"{ctx.current_length}, num_steps={num_steps}) but a replica holds only "
                    f"{self.total_num_pages * ps} ({self.total_num_pages} pages of {ps} tokens)"
                )
            if hits.device or num_new > 0:
                new_blocks = max(0, num_new - len(hits.device))
                hit_tokens = self._extend(state, ctx, new_blocks, hits)
        except InsufficientBlocksError:
            self.pool.refresh(reversed(hits.device))
            raise
        if looks_up and first_admission:  # as MAX's manager records it
            ctx.cached_prefix_length = hit_tokens
        self.metrics.input_tokens += ctx.active_length

    def _extend(self, state: RequestState, ctx: CacheContext, num_new: int, hits: PrefixHits) -> int:
        """Appends cached `hits.device`, then `num_new` fresh blocks (the first
        of them loaded with the tiers' hits), to the request. Returns the
        tokens served from cache."""
        pool = self.pool
        device_hits = hits.device
        ref_count = pool.ref_count
        free_after_hits = pool.num_free - list(map(ref_count.__getitem__, device_hits)).count(0)
        if num_new > free_after_hits:
            in_use = self.total_num_pages - pool.num_free
            raise InsufficientBlocksError(
                f"request {ctx.request_id!r} needs {num_new} new blocks on replica "
                f"{self.index} but only {free_after_hits} are free "
                f"({in_use}/{self.total_num_pages} in use)"
            )
        pool.touch(device_hits)
        for connector, tier_hits in hits.tiers:
            connector.reserve(tier_hits)
        new_blocks = pool.allocate(num_new)
        last_uid = pool.index.uid[device_hits[-1]] if device_hits else state.last_uid
        if hits.tiers:
            last_uid = self._load_tier_hits(state, ctx, hits, new_blocks, last_uid)
        self.table.write(state.row, state.num_blocks, device_hits + new_blocks)
        state.num_blocks += len(device_hits) + len(new_blocks)
        num_hits = len(device_hits) + hits.num_tier_hits
        state.num_committed += num_hits
        self.refresh(state)
        if not num_hits:
            return 0
        state.last_uid = last_uid
        cached_tokens = num_hits * self.page_size
        ctx.skip_processing(cached_tokens)
        self.metrics.cache_tokens += cached_tokens
        self.cache_tokens_by_salt[ctx.cache_salt] += cached_tokens
        return cached_tokens

    def _load_tier_hits(
        self, state: RequestState, ctx: CacheContext, hits: PrefixHits, blocks: list[int], last_uid: int
    ) -> int:
        """Loads each tier's hits into the first fresh `blocks` and commits
        them to the device prefix cache; returns the last one's uid."""
        i = state.num_committed + len(hits.device)  # the request's index of the next block
        row = len(hits.device)  # its row of hits.tokens
        cursor = 0
        for connector, tier_hits in hits.tiers:
            targets = blocks[cursor : cursor + len(tier_hits)]
            uids = connector.load(ctx.request_id, tier_hits, targets)
            saves = []
            for block, uid in zip(targets, uids, strict=True):
                parent_hash = state.hashes[i - 1] if i else state.root_hash
                tokens = hits.tokens[row]
                last_uid = self.pool.commit(block, state.hashes[i], last_uid, parent_hash, tokens, uid=uid)
                if self.keyer is not None:
                    saves.append(self._save_item(state, i, block, tokens))
                i += 1
                row += 1
            cursor += len(tier_hits)
            if connector.saves_on is SavePoint.COMMIT and saves:
                connector.sync()  # the loaded bytes are what the other tiers copy
                self._save_through(saves, source=connector)
        self.metrics.h2d_blocks_copied += cursor
        return last_uid

    def _hash_new_blocks(self, state: RequestState, ctx: CacheContext) -> None:
        """Extends `state.hashes` (and `state.keys`) to every full block before the last token."""
        ps = self.page_size
        done = len(state.hashes)
        hashable = (ctx.current_length - 1) // ps
        if hashable > done:
            if not done:
                self._start_chain(state, ctx.cache_salt)
            parent = state.hashes[-1] if done else state.root_hash
            tokens = ctx.tokens[done * ps : hashable * ps]
            state.hashes.extend(self.hasher.hash_blocks(tokens, parent))
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

    def _find_prefix_hits(self, state: RequestState, ctx: CacheContext) -> PrefixHits:
        """Verified cached blocks continuing the request: on the device, then on each tier.

        Only a request whose cached state ends exactly at its committed blocks
        (a new request, in practice) can take hits.
        """
        ps = self.page_size
        start = state.num_committed
        if state.chain_broken or state.num_blocks != start or ctx.processed_length != start * ps:
            return NO_HITS
        self._hash_new_blocks(state, ctx)
        wanted = state.hashes[start:]
        if not wanted:
            return NO_HITS
        tokens = ctx.tokens[start * ps : (start + len(wanted)) * ps].reshape(len(wanted), ps)
        index = self.pool.index
        device_hits = index.match(wanted, state.last_uid, tokens)
        hits = PrefixHits(device_hits, [], tokens)
        n = len(device_hits)
        if not self.connectors or n == len(wanted):
            return hits
        # A hash the device still maps (to a block that failed verification)
        # cannot be committed again, so tier hits stop there.
        end = next((i for i in range(n, len(wanted)) if index.get(wanted[i]) is not None), len(wanted))
        parent_uid: int | None = index.uid[device_hits[-1]] if device_hits else state.last_uid
        for connector in self.connectors:
            if n == end:
                break
            if connector.needs_keys:
                first = start + n
                parent_key = state.keys[first - 1] if first else state.root_key
                keys = state.keys[first : start + end]
            else:
                parent_key, keys = b"", ()
            query = PrefixQuery(ctx.request_id, wanted[n:end], tokens[n:end], parent_uid, keys, parent_key)
            found = connector.lookup(query)
            if found:
                hits.tiers.append((connector, found))
                n += len(found)
                parent_uid = None  # the chain now continues through blocks not yet on the device
        return hits

    def commit(self, due: Sequence[tuple[CacheContext, RequestState]]) -> None:
        """Offers each request's blocks up to its `processed_length` to the
        prefix cache, deduplicating against verified twins.

        `due` holds only requests with blocks to commit (the manager's
        `_due_entries`: no dummies, no broken chains). When none of their new
        blocks has a twin cached or elsewhere in the batch, they are committed
        in one pool call; otherwise as committing request by request in batch
        order would (`_commit_in_order`), which is where a batch goes at once
        when two runs start alike or one starts with a cached block (requests
        sharing a prefix none of them found cached). Newly cached blocks go to
        the write-through tiers.
        """
        if not self.prefix_caching or not due:
            return
        if not self._commit_tiers and self.keyer is None and self._commit_next_blocks(due):
            return
        runs, tokens = self._new_blocks(due)
        hashes = [state.hashes[first:full] for state, first, full, _ in runs]
        firsts = [run_hashes[0] for run_hashes in hashes if run_hashes]
        if (
            len(set(firsts)) < len(firsts)
            or self.pool.index.has_any(firsts)
            or not self._commit_runs(runs, hashes, tokens)
        ):
            self._commit_in_order(runs, hashes, tokens)
        for _, state in due:
            self.refresh(state)

    def _commit_next_blocks(self, due: Sequence[tuple[CacheContext, RequestState]]) -> bool:
        """`commit` for a decode step, where each due request has one new full
        block, right after its hashed ones: one vectorized hash and one pool
        call for the batch. Returns False, having changed nothing, for any
        other batch, or when a new block repeats or is cached (dedup is the
        general path's)."""
        ps = self.page_size
        rows: list[int] = []
        cols: list[int] = []
        parent_hashes: list[int] = []
        parent_uids: list[int] = []
        token_rows = []
        for ctx, state in due:
            i = state.num_committed
            if not i or ctx.processed_length // ps != i + 1 or len(state.hashes) != i:
                return False  # a chain's first block, several blocks, or ones hashed already
            rows.append(state.row)
            cols.append(i)
            parent_hashes.append(state.hashes[-1])
            parent_uids.append(state.last_uid)
            token_rows.append(ctx.tokens[i * ps : (i + 1) * ps])
        tokens = np.concatenate(token_rows).reshape(len(token_rows), ps)
        hashes = self.hasher.rehash(tokens, parent_hashes)
        blocks = self.table.read_cells(rows, cols)
        uids = self.pool.commit_blocks(blocks, hashes, parent_uids, parent_hashes, tokens)
        if uids is None:
            return False
        refresh = self.refresh
        for (_, state), block_hash, uid in zip(due, hashes, uids, strict=True):
            state.hashes.append(block_hash)
            state.last_uid = uid
            state.num_committed += 1
            refresh(state)
        return True

    def _new_blocks(self, due: Sequence[tuple[CacheContext, RequestState]]) -> tuple[list[Run], npt.NDArray[np.int64]]:
        """Each due request's run of blocks to commit, and their tokens in one
        matrix (runs in order). Hashes the blocks not hashed yet: one block
        after hashed ones (a decode step's, or a prefill's last) for the whole
        batch in one vectorized call, anything else per request."""
        ps = self.page_size
        runs: list[Run] = []
        rows = []
        next_blocks: list[int] = []  # rows of `tokens` hashed together
        next_states: list[RequestState] = []
        end = 0
        for ctx, state in due:
            first = state.num_committed
            full = min(ctx.processed_length // ps, state.num_blocks)
            rows.append(ctx.tokens[first * ps : full * ps])
            runs.append((state, first, full, end))
            end += full - first
            hashed = len(state.hashes)
            if hashed < full:
                # A first block starts the request's chain, and keyed tiers
                # extend the keys with the hashes: `_hash_new_blocks`.
                if hashed == full - 1 and hashed and self.keyer is None:
                    next_blocks.append(end - 1)
                    next_states.append(state)
                else:
                    self._hash_new_blocks(state, ctx)
        tokens = np.concatenate(rows).reshape(end, ps)
        if next_states:
            blocks = tokens if len(next_blocks) == end else tokens[next_blocks]  # all of them after a decode step
            hashes = self.hasher.rehash(blocks, [state.hashes[-1] for state in next_states])
            for state, block_hash in zip(next_states, hashes, strict=True):
                state.hashes.append(block_hash)
        return runs, tokens

    def _commit_in_order(self, runs: list[Run], hashes: list[list[int]], tokens: npt.NDArray[np.int64]) -> None:
        """`commit` for a batch where some new block repeats or is cached:
        the state committing request by request in batch order ends in
        (uids aside: they are assigned in another order).

        Leaders (runs none of whose blocks is cached or in an earlier run of
        the batch) go first, in one call: that changes nothing for the others,
        which look the leaders' hashes up only after the leaders would have
        committed them. Then each other request in turn swaps its leading
        blocks for their verified twins (`_swap_twins`). What is left of its
        run, when none of it is cached or in another run, nobody else in the
        batch can match: such rests are committed together at the end; any
        other rest at its turn (`_commit_rest`), as is a leader whose own
        blocks repeat a hash (so that the leaders' call fails)."""
        index = self.pool.index
        seen: set[int] = set()
        repeated: set[int] = set()
        leaders = []
        for k, run_hashes in enumerate(hashes):
            if seen.isdisjoint(run_hashes):
                if not index.has_any(run_hashes):
                    leaders.append(k)
            else:
                repeated.update(seen.intersection(run_hashes))
            seen.update(run_hashes)
        if leaders:
            picked = np.concatenate([np.arange(runs[k][3], runs[k][3] + len(hashes[k])) for k in leaders])
            self._commit_runs([runs[k] for k in leaders], [hashes[k] for k in leaders], tokens[picked])
        rests: list[Run] = []
        rest_rows = []
        for state, start, full, row in runs:
            if state.num_committed == full:  # a leader
                continue
            self._swap_twins(state, full, tokens[row : row + full - start])
            first = state.num_committed
            if first == full:
                continue
            rest = state.hashes[first:full]
            rest_tokens = tokens[row + first - start : row + full - start]
            if repeated.isdisjoint(rest) and not index.has_any(rest) and len(set(rest)) == len(rest):
                rests.append((state, first, full, 0))
                rest_rows.append(rest_tokens)
            else:  # also a leader whose own hashes repeat (its commit above failed)
                self._commit_rest(state, full, rest_tokens)
        if rests and not self._commit_runs(
            rests, [state.hashes[first:full] for state, first, full, _ in rests], np.concatenate(rest_rows)
        ):
            raise AssertionError("rests with hashes of their own only could not be committed")

    def _commit_runs(self, runs: list[Run], hashes: list[list[int]], tokens: npt.NDArray[np.int64]) -> bool:
        """Commits every run's blocks (freshly computed) in one pool call;
        `hashes` are the runs' blocks' hashes and `tokens` their rows, runs in
        order. Returns False, having changed nothing, when a hash repeats or
        is cached."""
        read = self.table.read
        chains = []
        for (state, first, full, _), run_hashes in zip(runs, hashes, strict=True):
            parent_hash = state.hashes[first - 1] if first else state.root_hash
            chains.append((read(state.row, first, full), run_hashes, state.last_uid, parent_hash))
        last_uids = self.pool.commit_chains(chains, tokens)
        if last_uids is None:
            return False
        for (state, _, full, _), uid in zip(runs, last_uids, strict=True):
            state.last_uid = uid
            state.num_committed = full
        if self._commit_tiers:
            saves = []
            for (state, first, _, _), (chain_blocks, *_) in zip(runs, chains, strict=True):
                for i, block in enumerate(chain_blocks, first):
                    saves.append(self._save_item(state, i, block, tokens[len(saves)]))
            self._save_through(saves)
        return True

    def _swap_twins(self, state: RequestState, full: int, tokens: npt.NDArray[np.int64]) -> None:
        """Swaps the request's leading uncommitted blocks (up to block `full`,
        `tokens` their rows) whose verified twins are cached (requests sharing
        a prefix, admitted before either committed it) for those twins, and
        frees its own."""
        first = state.num_committed
        pool = self.pool
        twins = pool.index.match(state.hashes[first:full], state.last_uid, tokens)
        if twins:
            pool.touch(twins)
            pool.free(self.table.read(state.row, first, first + len(twins)))
            self.table.write(state.row, first, twins)
            state.last_uid = pool.index.uid[twins[-1]]
            state.num_committed = first + len(twins)

    def _commit_rest(self, state: RequestState, full: int, tokens: npt.NDArray[np.int64]) -> None:
        """Commits the request's blocks from `num_committed` up to `full`
        (`tokens`: their rows) after `_swap_twins`: in one call when none of
        their hashes is taken, else one by one up to a hash taken by a block
        someone holds, where the request's chain stops (`chain_broken`).

        A taken hash here is never a verified twin: `_swap_twins` took every
        one continuing the chain, and each later block's parent is a block
        committed just now, which no cached entry can name. It is a collision
        (or an orphan): an entry nobody holds is replaced."""
        first = state.num_committed
        if self._commit_runs([(state, first, full, 0)], [state.hashes[first:full]], tokens):
            return
        pool = self.pool
        saves: list[BlockToSave] = []
        committed: list[int] = []
        for j, block in enumerate(self.table.read(state.row, first, full)):
            i = first + j
            block_hash = state.hashes[i]
            cached = pool.index.get(block_hash)
            if cached is not None:
                if pool.ref_count[cached]:
                    state.chain_broken = True
                    break
                pool.uncommit(cached)
            parent_hash = state.hashes[i - 1] if i else state.root_hash
            state.last_uid = pool.commit(block, block_hash, state.last_uid, parent_hash, None)
            state.num_committed = i + 1
            committed.append(block)
            if self._commit_tiers:
                saves.append(self._save_item(state, i, block, tokens[j]))
        pool.index.tokens[committed] = tokens[: len(committed)]  # one store for the rows committed
        if saves:
            self._save_through(saves)

    def release(self, request_id: Hashable) -> None:
        """Returns a request's pages; cached ones stay reusable until evicted."""
        state = self.requests.pop(request_id)
        for connector in self.connectors:
            connector.request_complete(request_id)
        if not state.is_dummy:
            blocks = self.table.read(state.row, 0, state.num_blocks)
            if self.prefix_caching:
                blocks.reverse()
            self.pool.free(blocks)
        self.table.drop_row(state.row, state.num_blocks)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block no request holds, and every tier's pages."""
        self.pool.reset_prefix_cache()
        for connector in self.connectors:
            connector.reset()

    def shutdown(self) -> None:
        """Lets every tier finish its copies and release its threads, files and connections."""
        for connector in self.connectors:
            connector.shutdown()

    def check_invariants(self) -> None:
        """Asserts the pool, the requests' table rows and the host tier agree."""
        holders: Counter[int] = Counter()
        for request_id, state in self.requests.items():
            refreshed = replace(state)
            self.refresh(refreshed)
            if (state.due_at, state.capacity) != (refreshed.due_at, refreshed.capacity):
                raise AssertionError(
                    f"request {request_id!r} is due at {state.due_at} with capacity {state.capacity}, "
                    f"not {refreshed.due_at} and {refreshed.capacity}"
                )
            if not state.is_dummy:
                holders.update(self.table.read(state.row, 0, state.num_blocks))
        self.pool.check_invariants(holders, self.hasher)
        if self.host is not None:
            self.host.check_invariants(self.hasher)

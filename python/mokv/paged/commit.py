"""Committing a batch's newly full pages to the device prefix cache (`step`).

Each request offers its pages up to its `processed_length`; a page whose
verified twin is already cached is swapped for the twin (dedup) and freed.
The result is defined as if the requests committed one by one in batch
order, and three paths reach it, cheapest first:

* a decode step (each request has one new page, right after its hashed
  ones): one vectorized hash and one pool call for the whole batch;
* no new page has a twin cached or elsewhere in the batch: one pool call;
* otherwise, in batch order (`_commit_in_order`): requests sharing a prefix
  none of them found cached, admitted together, meet here.

Newly cached pages go to the write-through tiers (disk, remote).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..prefix import PageHasher
from ..tiers import PageToSave, Tier
from ..tiers.keys import PageKeyer
from .page_pool import Chain, PagePool
from .page_table import PageTable
from .prefix_lookup import PrefixLookup
from .request_state import BatchEntry, RequestState


@dataclass(frozen=True, slots=True)
class Run:
    """A request's pages to commit in one `CommitEngine.commit`."""

    state: RequestState
    first: int
    """The request's index of its first page to commit."""
    full: int
    """One past its last full page to commit."""
    row: int
    """Row of the batch's token matrix holding page `first`'s tokens."""


class CommitEngine:
    """Commits one replica's due requests (see the module docstring).

    Args:
        page_size: Tokens per page.
        prefix_caching: Whether full pages are committed at all.
        hasher: The manager's page hasher.
        keyer: Keys of the cross-process chain (None when no tier needs them).
        pool: The replica's page pool.
        table: The replica's page table.
        lookup: Extends requests' chains (`PrefixLookup.hash_new_pages`).
        has_commit_tiers: Whether a write-through tier takes committed pages.
        save_through: Hands newly cached pages to the write-through tiers.
    """

    def __init__(
        self,
        page_size: int,
        prefix_caching: bool,
        hasher: PageHasher,
        keyer: PageKeyer | None,
        pool: PagePool,
        table: PageTable,
        lookup: PrefixLookup,
        has_commit_tiers: bool,
        save_through: Callable[[list[PageToSave], Tier | None], None],
    ) -> None:
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.hasher = hasher
        self.keyer = keyer
        self.pool = pool
        self.table = table
        self.lookup = lookup
        self.has_commit_tiers = has_commit_tiers
        self.save_through = save_through

    def commit(self, due: Sequence[BatchEntry]) -> None:
        """Offers each request's pages up to its `processed_length` to the
        prefix cache, deduplicating against verified twins.

        `due` holds only requests with pages to commit (no dummies, no broken
        chains: `batch_resolution.due_entries`).
        """
        if not self.prefix_caching or not due:
            return
        if not self.has_commit_tiers and self.keyer is None and self._commit_next_pages(due):
            return
        runs, tokens = self._new_pages(due)
        hashes = [run.state.hashes[run.first : run.full] for run in runs]
        firsts = [run_hashes[0] for run_hashes in hashes if run_hashes]
        if (
            len(set(firsts)) < len(firsts)
            or self.pool.index.has_any(firsts)
            or not self._commit_runs(runs, hashes, tokens)
        ):
            self._commit_in_order(runs, hashes, tokens)
        ps, prefix_caching = self.page_size, self.prefix_caching
        for _, state in due:
            state.update_thresholds(ps, prefix_caching)

    def _commit_next_pages(self, due: Sequence[BatchEntry]) -> bool:
        """`commit` for a decode step, where each due request has one new full
        page, right after its hashed ones: one vectorized hash and one pool
        call for the batch. Returns False, having changed nothing, for any
        other batch, or when a new page repeats or is cached (dedup is the
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
                return False  # a chain's first page, several pages, or ones hashed already
            rows.append(state.row)
            cols.append(i)
            parent_hashes.append(state.hashes[-1])
            parent_uids.append(state.last_uid)
            token_rows.append(ctx.tokens[i * ps : (i + 1) * ps])
        tokens = np.concatenate(token_rows).reshape(len(token_rows), ps)
        hashes = self.hasher.rehash(tokens, parent_hashes)
        pages = self.table.read_cells(rows, cols)
        uids = self.pool.commit_pages(pages, hashes, parent_uids, parent_hashes, tokens)
        if uids is None:
            return False
        prefix_caching = self.prefix_caching
        for (_, state), page_hash, uid in zip(due, hashes, uids, strict=True):
            state.hashes.append(page_hash)
            state.last_uid = uid
            state.num_committed += 1
            state.update_thresholds(ps, prefix_caching)
        return True

    def _new_pages(self, due: Sequence[BatchEntry]) -> tuple[list[Run], npt.NDArray[np.int64]]:
        """Each due request's run of pages to commit, and their tokens in one
        matrix (runs in order). Hashes the pages not hashed yet: one page
        after hashed ones (a decode step's, or a prefill's last) for the whole
        batch in one vectorized call, anything else per request."""
        ps = self.page_size
        runs: list[Run] = []
        rows = []
        next_pages: list[int] = []  # rows of `tokens` hashed together
        next_states: list[RequestState] = []
        end = 0
        for ctx, state in due:
            first = state.num_committed
            full = min(ctx.processed_length // ps, state.num_pages)
            rows.append(ctx.tokens[first * ps : full * ps])
            runs.append(Run(state, first, full, end))
            end += full - first
            hashed = len(state.hashes)
            if hashed < full:
                # A first page starts the request's chain, and keyed tiers
                # extend the keys with the hashes: `hash_new_pages`.
                if hashed == full - 1 and hashed and self.keyer is None:
                    next_pages.append(end - 1)
                    next_states.append(state)
                else:
                    self.lookup.hash_new_pages(state, ctx)
        tokens = np.concatenate(rows).reshape(end, ps)
        if next_states:
            pages = tokens if len(next_pages) == end else tokens[next_pages]  # all of them after a decode step
            hashes = self.hasher.rehash(pages, [state.hashes[-1] for state in next_states])
            for state, page_hash in zip(next_states, hashes, strict=True):
                state.hashes.append(page_hash)
        return runs, tokens

    def _commit_in_order(self, runs: list[Run], hashes: list[list[int]], tokens: npt.NDArray[np.int64]) -> None:
        """`commit` for a batch where some new page repeats or is cached:
        the state committing request by request in batch order ends in
        (uids aside: they are assigned in another order).

        Leaders (runs none of whose pages is cached or in an earlier run of
        the batch) go first, in one call: that changes nothing for the others,
        which look the leaders' hashes up only after the leaders would have
        committed them. Then each other request in turn swaps its leading
        pages for their verified twins (`_swap_twins`). What is left of its
        run, when none of it is cached or in another run, nobody else in the
        batch can match: such rests are committed together at the end; any
        other rest at its turn (`_commit_rest`), as is a leader whose own
        pages repeat a hash (so that the leaders' call fails)."""
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
            picked = np.concatenate([np.arange(runs[k].row, runs[k].row + len(hashes[k])) for k in leaders])
            self._commit_runs([runs[k] for k in leaders], [hashes[k] for k in leaders], tokens[picked])
        rests: list[Run] = []
        rest_rows = []
        for run in runs:
            state, start, full, row = run.state, run.first, run.full, run.row
            if state.num_committed == full:  # a leader
                continue
            self._swap_twins(state, full, tokens[row : row + full - start])
            first = state.num_committed
            if first == full:
                continue
            rest = state.hashes[first:full]
            rest_tokens = tokens[row + first - start : row + full - start]
            if repeated.isdisjoint(rest) and not index.has_any(rest) and len(set(rest)) == len(rest):
                rests.append(Run(state, first, full, 0))
                rest_rows.append(rest_tokens)
            else:  # also a leader whose own hashes repeat (its commit above failed)
                self._commit_rest(state, full, rest_tokens)
        if rests and not self._commit_runs(
            rests, [run.state.hashes[run.first : run.full] for run in rests], np.concatenate(rest_rows)
        ):
            raise AssertionError("rests with hashes of their own only could not be committed")

    def _commit_runs(self, runs: list[Run], hashes: list[list[int]], tokens: npt.NDArray[np.int64]) -> bool:
        """Commits every run's pages (freshly computed) in one pool call;
        `hashes` are the runs' pages' hashes and `tokens` their rows, runs in
        order. Returns False, having changed nothing, when a hash repeats or
        is cached."""
        read = self.table.read
        chains = []
        for run, run_hashes in zip(runs, hashes, strict=True):
            state, first = run.state, run.first
            parent_hash = state.hashes[first - 1] if first else state.root_hash
            chains.append(Chain(read(state.row, first, run.full), run_hashes, state.last_uid, parent_hash))
        last_uids = self.pool.commit_chains(chains, tokens)
        if last_uids is None:
            return False
        for run, uid in zip(runs, last_uids, strict=True):
            run.state.last_uid = uid
            run.state.num_committed = run.full
        if self.has_commit_tiers:
            saves: list[PageToSave] = []
            for run, chain in zip(runs, chains, strict=True):
                for i, page in enumerate(chain.pages, run.first):
                    saves.append(run.state.page_to_save(i, page, tokens[len(saves)]))
            self.save_through(saves, None)
        return True

    def _swap_twins(self, state: RequestState, full: int, tokens: npt.NDArray[np.int64]) -> None:
        """Swaps the request's leading uncommitted pages (up to page `full`,
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
        """Commits the request's pages from `num_committed` up to `full`
        (`tokens`: their rows) after `_swap_twins`: in one call when none of
        their hashes is taken, else one by one up to a hash taken by a page
        someone holds, where the request's chain stops (`chain_broken`).

        A taken hash here is never a verified twin: `_swap_twins` took every
        one continuing the chain, and each later page's parent is a page
        committed just now, which no cached entry can name. It is a collision
        (or an orphan): an entry nobody holds is replaced."""
        first = state.num_committed
        if self._commit_runs([Run(state, first, full, 0)], [state.hashes[first:full]], tokens):
            return
        pool = self.pool
        saves: list[PageToSave] = []
        committed: list[int] = []
        for j, page in enumerate(self.table.read(state.row, first, full)):
            i = first + j
            page_hash = state.hashes[i]
            cached = pool.index.get(page_hash)
            if cached is not None:
                if pool.ref_count[cached]:
                    state.chain_broken = True
                    break
                pool.uncommit(cached)
            parent_hash = state.hashes[i - 1] if i else state.root_hash
            state.last_uid = pool.commit(page, page_hash, state.last_uid, parent_hash, None)
            state.num_committed = i + 1
            committed.append(page)
            if self.has_commit_tiers:
                saves.append(state.page_to_save(i, page, tokens[j]))
        pool.index.tokens[committed] = tokens[: len(committed)]  # one store for the rows committed
        if saves:
            self.save_through(saves, None)

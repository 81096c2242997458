"""One replica's device blocks: who owns each block, and which hold cached prefixes.

At any moment a block is in exactly one of three states:

* free: ref count 0, in the free queue, not in the prefix cache;
* cached: ref count 0, in the free queue *and* in the prefix cache: its KV is
  still valid and a request with the same prefix may take it back (a hit)
  until the queue hands it out again (an eviction);
* used: ref count N > 0, held by N requests, out of the free queue (and in the
  prefix cache once it is full and committed).

The free queue is an `OrderedDict` used as an LRU list: blocks are handed out
from the front and returned to the back, and a hit removes a cached block from
the middle, all in O(1). Managers free a request's blocks tail first, so a
shared prefix's head outlives its tails.

A cached block is only reused when its stored tokens equal the request's and
its parent (the block before it when it was committed) is the block the request
matched just before; every committed block gets a fresh `uid` for that check.
Together these make a reused block's whole prefix equal to the request's, so a
hash collision can cost a hit but never serve the wrong KV.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

import numpy as np
import numpy.typing as npt

from .hashing import BlockHasher

NO_UID = 0
"""The `uid` of "no block": the parent of a request's first block."""


class PageIndex:
    """Committed pages of one tier (device blocks or host pages), by chained hash.

    For each slot it keeps what a hit must verify: the hash, the slot's `uid`,
    its parent's `uid` and hash, and the page's tokens.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        self._by_hash: dict[int, int] = {}
        self.hash: list[int | None] = [None] * num_slots
        self.uid: list[int] = [NO_UID] * num_slots
        self.parent_uid: list[int] = [NO_UID] * num_slots
        self.parent_hash: list[int | None] = [None] * num_slots
        self.tokens: npt.NDArray[np.int64] = np.zeros((num_slots, page_size), dtype=np.int64)

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, block_hash: int) -> int | None:
        """The slot committed under `block_hash`, if any."""
        return self._by_hash.get(block_hash)

    def has_any(self, hashes: Iterable[int]) -> bool:
        """Whether any of `hashes` is committed."""
        return not self._by_hash.keys().isdisjoint(hashes)

    def is_committed(self, slot: int) -> bool:
        """Whether `slot` holds a committed page."""
        return self.hash[slot] is not None

    def insert(
        self,
        slot: int,
        block_hash: int,
        uid: int,
        parent_uid: int,
        parent_hash: int | None,
        tokens: npt.NDArray[np.integer] | None,
    ) -> None:
        """Commits `slot` under `block_hash`, which must be free in this index.
        With `tokens` None the caller stores the slot's row of `self.tokens`
        itself (several slots in one numpy call) before the next lookup."""
        if block_hash in self._by_hash:
            raise ValueError(f"hash {block_hash:#x} is already committed to slot {self._by_hash[block_hash]}")
        if self.hash[slot] is not None:
            raise ValueError(f"slot {slot} is already committed")
        self._by_hash[block_hash] = slot
        self.hash[slot] = block_hash
        self.uid[slot] = uid
        self.parent_uid[slot] = parent_uid
        self.parent_hash[slot] = parent_hash
        if tokens is not None:
            self.tokens[slot] = tokens

    def insert_many(
        self,
        slots: list[int],
        hashes: list[int],
        first_uid: int,
        parent_uids: Sequence[int],
        parent_hashes: Sequence[int | None],
        tokens: npt.NDArray[np.integer],
    ) -> bool:
        """Commits several slots at once: slot k gets `hashes[k]`, uid
        `first_uid + k` and, as parent, `parent_uids[k]` / `parent_hashes[k]`;
        `tokens` has one row per slot. Returns False, having written nothing,
        when a hash repeats or is committed already.

        Raises:
            ValueError: A slot repeats or is committed already.
        """
        own_hash, by_hash = self.hash, self._by_hash
        if len(set(slots)) != len(slots) or [own_hash[slot] for slot in slots].count(None) != len(slots):
            raise ValueError(f"slots {slots} repeat or are already committed")
        if not by_hash.keys().isdisjoint(hashes):
            return False
        size = len(by_hash)
        by_hash.update(zip(hashes, slots, strict=True))
        if len(by_hash) != size + len(hashes):  # a hash repeats among `hashes`
            for block_hash in hashes:
                by_hash.pop(block_hash, None)
            return False
        uid, parent_uid, parent_hash = self.uid, self.parent_uid, self.parent_hash
        uids = range(first_uid, first_uid + len(slots))
        for slot, block_hash, slot_uid, parent, parents_hash in zip(
            slots, hashes, uids, parent_uids, parent_hashes, strict=True
        ):
            own_hash[slot] = block_hash
            uid[slot] = slot_uid
            parent_uid[slot] = parent
            parent_hash[slot] = parents_hash
        self.tokens[np.array(slots, np.intp)] = tokens
        return True

    def copy_entry(self, slot: int, source: PageIndex, source_slot: int) -> None:
        """Commits `slot` with the identity of `source`'s `source_slot` (a tier move)."""
        block_hash = source.hash[source_slot]
        assert block_hash is not None
        self.insert(
            slot,
            block_hash,
            source.uid[source_slot],
            source.parent_uid[source_slot],
            source.parent_hash[source_slot],
            source.tokens[source_slot],
        )

    def remove(self, slot: int) -> None:
        """Uncommits `slot`."""
        self.remove_many([slot])

    def remove_many(self, slots: list[int]) -> None:
        """Uncommits each of `slots` (committed ones, each once)."""
        by_hash, own_hash, uid = self._by_hash, self.hash, self.uid
        for slot in slots:
            del by_hash[own_hash[slot]]
            own_hash[slot] = None
            uid[slot] = NO_UID

    def match(self, hashes: Sequence[int], parent_uid: int, tokens: npt.NDArray[np.integer]) -> list[int]:
        """The longest run of slots continuing a chain, verified.

        Args:
            hashes: Chained hashes of the request's next blocks.
            parent_uid: `uid` of the block before them (`NO_UID` at the start).
            tokens: Those blocks' tokens, `[len(hashes), page_size]`.

        Returns:
            Slots for a prefix of `hashes` whose parents chain up to
            `parent_uid` and whose stored tokens equal `tokens`.
        """
        slots: list[int] = []
        slot_of, parent_uid_of, uid_of = self._by_hash.get, self.parent_uid, self.uid
        for block_hash in hashes:
            slot = slot_of(block_hash)
            if slot is None or parent_uid_of[slot] != parent_uid:
                break
            slots.append(slot)
            parent_uid = uid_of[slot]
        if slots:  # one bytes comparison for the whole run; rows only on a mismatch
            stored, wanted = self.tokens[slots], np.asarray(tokens[: len(slots)], np.int64)
            if stored.tobytes() != wanted.tobytes():
                same = (stored == wanted).all(axis=1)
                del slots[int(np.argmin(same)) :]
        return slots

    def committed_slots(self) -> list[int]:
        """Every committed slot."""
        return list(self._by_hash.values())

    def check(self, hasher: BlockHasher) -> None:
        """Asserts every committed hash names a slot holding exactly those tokens."""
        for block_hash, slot in self._by_hash.items():
            if self.hash[slot] != block_hash:
                raise AssertionError(f"hash {block_hash:#x} maps to slot {slot} committed as {self.hash[slot]}")
        slots = list(self._by_hash.values())
        expected = hasher.rehash(self.tokens[slots], [self.parent_hash[s] for s in slots])
        for slot, block_hash in zip(slots, expected, strict=True):
            if block_hash != self.hash[slot]:
                raise AssertionError(f"slot {slot}'s tokens hash to {block_hash:#x}, not {self.hash[slot]:#x}")
        if len(self.hash) - self.hash.count(None) != len(self._by_hash):
            raise AssertionError("some slots carry hashes the index does not map to them")


class BlockPool:
    """Blocks `0 .. num_blocks-1` of one replica (the null page is not one of them).

    Args:
        num_blocks: Blocks in the pool.
        page_size: Tokens per block.
        on_evict: Called with a cached block's id just before the block is
            handed out again, while its KV is still intact (the host tier
            copies it out).
    """

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.ref_count: list[int] = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.index = PageIndex(num_blocks, page_size)
        self.on_evict = on_evict
        self._last_uid = NO_UID

    @property
    def num_free(self) -> int:
        """Blocks no request holds (free or cached)."""
        return len(self._free)

    def free_order(self) -> list[int]:
        """The free queue, next block to hand out first."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hands out `n` blocks from the front of the free queue, evicting cached ones."""
        if n > len(self._free):
            raise ValueError(f"cannot hand out {n} blocks, {len(self._free)} are free")
        free = self._free
        blocks = list(islice(free, n))
        for block in blocks:
            del free[block]
        committed = self.index.hash
        evicted = [block for block in blocks if committed[block] is not None]
        if evicted:
            if self.on_evict is not None:
                for block in evicted:
                    self.on_evict(block)
            self.index.remove_many(evicted)
        ref_count = self.ref_count
        for block in blocks:
            ref_count[block] = 1
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Adds a holder to each of `blocks`, taking cached ones off the free queue."""
        ref_count, free = self.ref_count, self._free
        for block in blocks:
            if not ref_count[block]:
                del free[block]
            ref_count[block] += 1

    def refresh(self, blocks: Iterable[int]) -> None:
        """Moves each unheld block to the back of the free queue, in order: a
        use that took no hold (MAX's failed allocation touches its hits)."""
        for block in blocks:
            if self.ref_count[block] == 0:
                self._free.move_to_end(block)

    def free(self, blocks: list[int]) -> None:
        """Drops one holder from each of `blocks` (distinct); unheld ones go to
        the back of the queue, in order. Changes nothing if one is unheld."""
        ref_count, free = self.ref_count, self._free
        if blocks and min(map(ref_count.__getitem__, blocks)) < 1:
            unheld = next(block for block in blocks if ref_count[block] < 1)
            raise ValueError(f"block {unheld} freed more often than it was held")
        for block in blocks:
            count = ref_count[block] - 1
            ref_count[block] = count
            if not count:
                free[block] = None

    def commit(
        self,
        block: int,
        block_hash: int,
        parent_uid: int,
        parent_hash: int | None,
        tokens: npt.NDArray[np.integer] | None,
        uid: int = NO_UID,
    ) -> int:
        """Puts a full block in the prefix cache and returns its `uid`: a new
        one for a freshly computed (or freshly loaded) block, or `uid` for a
        block restored from a tier that kept the identity this pool gave it
        (`tokens` as in `PageIndex.insert`)."""
        if uid == NO_UID:
            self._last_uid += 1
            uid = self._last_uid
        self.index.insert(block, block_hash, uid, parent_uid, parent_hash, tokens)
        return uid

    def commit_chains(
        self, chains: list[tuple[list[int], list[int], int, int | None]], tokens: npt.NDArray[np.integer]
    ) -> list[int] | None:
        """`commit` for runs of freshly computed blocks in one call: each chain
        is `(blocks, hashes, parent_uid, parent_hash)`, its blocks following
        its parent and each other; `tokens` has one row per block, chains in
        order. Returns each chain's last uid (`parent_uid` for an empty one),
        or None, having changed nothing, if a hash repeats or is cached already."""
        blocks: list[int] = []
        hashes: list[int] = []
        parent_uids: list[int] = []
        parent_hashes: list[int | None] = []
        last_uids = []
        uid = self._last_uid
        for chain_blocks, chain_hashes, parent_uid, parent_hash in chains:
            n = len(chain_blocks)
            if n:
                blocks += chain_blocks
                hashes += chain_hashes
                parent_uids.append(parent_uid)
                parent_hashes.append(parent_hash)
                if n > 1:  # each later block's parent is the one before it
                    parent_uids += range(uid + 1, uid + n)
                    parent_hashes += chain_hashes[:-1]
                uid += n
            last_uids.append(uid if n else parent_uid)
        if self.commit_blocks(blocks, hashes, parent_uids, parent_hashes, tokens) is None:
            return None
        return last_uids

    def commit_blocks(
        self,
        blocks: list[int],
        hashes: list[int],
        parent_uids: Sequence[int],
        parent_hashes: Sequence[int | None],
        tokens: npt.NDArray[np.integer],
    ) -> range | None:
        """`commit` for freshly computed blocks in one call: block k gets
        `hashes[k]`, its parent's uid and hash, and row k of `tokens`. Returns
        their new uids, or None, having changed nothing, if a hash repeats or
        is cached already."""
        first_uid = self._last_uid + 1
        if not self.index.insert_many(blocks, hashes, first_uid, parent_uids, parent_hashes, tokens):
            return None
        self._last_uid += len(blocks)
        return range(first_uid, self._last_uid + 1)

    def uncommit(self, block: int) -> None:
        """Takes a block out of the prefix cache (it keeps its holders)."""
        self.index.remove(block)

    def reset_prefix_cache(self) -> int:
        """Uncommits every cached block no request holds; returns how many."""
        dropped = [b for b in self.index.committed_slots() if self.ref_count[b] == 0]
        for block in dropped:
            self.index.remove(block)
        return len(dropped)

    def check_invariants(self, holders: Counter[int], hasher: BlockHasher) -> None:
        """Asserts the pool agrees with `holders` (block -> requests holding it)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is in the free queue twice")
        used = {b for b, n in holders.items() if n}
        if len(free) + len(used) != self.num_blocks or free & used:
            raise AssertionError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_blocks}); "
                f"both free and used: {sorted(free & used)}"
            )
        for block, count in holders.items():
            if self.ref_count[block] != count:
                raise AssertionError(f"block {block} has ref count {self.ref_count[block]} but {count} holders")
        if self.ref_count.count(0) != self.num_blocks - len(used):
            raise AssertionError("a block nobody holds has a nonzero ref count")
        self.index.check(hasher)

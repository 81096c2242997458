"""The one interface between a replica and the tiers below its device pool.

A replica (`mokv.paged.replica`) keeps its device prefix cache itself and talks
to every lower tier (host memory, a disk directory, a remote store) through a
`KVConnector`, in a fixed order: the first tier that continues a request's
verified chain serves the next blocks, the next tier continues after it. The
interface follows MAX's `KVConnector` (lookup, load, save, flush, request
complete, reset, shutdown, metrics) in the manager's own terms:

* `lookup(query)` -> hits: the longest run of the query's blocks the tier
  holds and has verified (tokens and chain; checksum or MAC for stored
  records). No side effects: the caller may drop the hits.
* `reserve(hits)`: keeps them until `load` (the host tier pins pages so the
  allocation that follows cannot evict them).
* `load(request_id, hits, blocks)`: fills fresh device `blocks` with them; the
  copies may land later, but before `sync()` (or `request_complete`) returns.
* `save(blocks)`: takes device blocks at the tier's `saves_on` moment: on
  commit (write-through: disk, remote) or on eviction (the host victim cache).
* `sync()`: every load has landed (the manager calls it before
  `runtime_inputs` returns). `flush()`: every save is durable.
* `request_complete(request_id)`: the request's loads have landed, so its
  blocks may be freed.
* `reset()`, `shutdown()`, `usage()`, `metrics`.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..metrics import Counters


class SavePoint(enum.Enum):
    """When a tier takes copies of device blocks."""

    COMMIT = "commit"
    """Write-through: every block the moment it enters the device prefix cache."""
    EVICT = "evict"
    """Victim cache: a cached block just before the device pool hands it out again."""


@dataclass(frozen=True)
class PrefixQuery:
    """A request's next full blocks, after those the device already serves.

    Attributes:
        request_id: The request asking.
        hashes: The blocks' 64-bit chained hashes (device and host index keys).
        tokens: Their tokens, `[len(hashes), page_size]`.
        parent_uid: `uid` of the block before them (the per-process chain), or
            None when that block is itself a lower tier's hit, not yet loaded:
            then only key-chained tiers can continue the chain.
        keys: Their cryptographic chained keys (`keys.BlockKeyer`), the
            cross-process chain; empty when no tier needs them.
        parent_key: Key of the block before them.
    """

    request_id: Hashable
    hashes: Sequence[int]
    tokens: npt.NDArray[np.int64]
    parent_uid: int | None
    keys: Sequence[bytes] = ()
    parent_key: bytes = b""

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class BlockToSave:
    """A device block a tier may copy, with its cross-process identity."""

    block: int
    key: bytes = b""
    parent_key: bytes = b""
    tokens: npt.NDArray[np.int64] | None = None


@dataclass(frozen=True)
class TierUsage:
    """A tier's occupancy."""

    used_pages: int
    total_pages: int
    used_bytes: int
    total_bytes: int


@dataclass
class TierMetrics(Counters):
    """Counters of one tier (summed over replicas by the manager)."""

    lookups: int = 0
    """Prefix lookups that reached this tier."""
    hit_blocks: int = 0
    """Blocks loaded into device blocks from this tier."""
    hit_bytes: int = 0
    load_seconds: float = 0.0
    """Wall time spent reading and verifying hits (lookups included)."""
    saved_blocks: int = 0
    """Blocks copied into this tier."""
    saved_bytes: int = 0
    save_seconds: float = 0.0
    """Writer time spent encoding and writing saved blocks."""
    rejected_blocks: int = 0
    """Stored blocks that failed verification (corrupt, foreign, mismatched, bad MAC): misses."""
    unauthenticated_blocks: int = 0
    """Of `rejected_blocks`, those whose MAC did not verify under this process's key."""
    dropped_saves: int = 0
    """Saves given up (writer backlog full, tier disabled or unreachable)."""
    errors: int = 0
    """I/O or connection failures, each served as a miss."""

    @property
    def read_gb_per_s(self) -> float:
        """Hit bytes over the time spent reading them."""
        return self.hit_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    @property
    def write_gb_per_s(self) -> float:
        """Saved bytes over the writer time spent on them."""
        return self.saved_bytes / self.save_seconds / 1e9 if self.save_seconds else 0.0


@runtime_checkable
class KVConnector(Protocol):
    """A tier below one replica's device pool (see the module docstring)."""

    name: str
    """Short tier name for metrics and messages: "host", "disk", "remote"."""
    saves_on: SavePoint
    needs_keys: bool
    """Whether lookups need `PrefixQuery.keys` (the cross-process chain)."""
    metrics: TierMetrics

    def lookup(self, query: PrefixQuery) -> Sequence[object]:
        """Verified hits for a prefix of `query`'s blocks, one opaque item per block."""
        ...

    def reserve(self, hits: Sequence[object]) -> None:
        """Keeps `hits` available until `load` takes them."""
        ...

    def load(self, request_id: Hashable, hits: Sequence[object], blocks: Sequence[int]) -> list[int]:
        """Fills device `blocks` with `hits`; returns the uid each block keeps
        (`NO_UID`: the replica gives it a fresh one)."""
        ...

    def save(self, blocks: Sequence[BlockToSave]) -> int:
        """Copies device blocks into the tier (at its `saves_on` moment);
        returns how many it copied."""
        ...

    def sync(self) -> None:
        """Returns once every load's copies have landed in device memory."""
        ...

    def flush(self) -> None:
        """Returns once every save is stored (written, sent)."""
        ...

    def request_complete(self, request_id: Hashable) -> None:
        """Returns once the request's loads have landed, so its blocks may be freed."""
        ...

    def reset(self) -> None:
        """Drops every page the tier holds for this cache layout (on a shared
        tier, for every process using it)."""
        ...

    def shutdown(self) -> None:
        """Flushes and releases threads, files and connections."""
        ...

    def usage(self) -> TierUsage:
        """The tier's occupancy as this process sees it."""
        ...

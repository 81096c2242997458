"""The one interface between a replica and the tiers below its device pool.

A replica (`mokv.paged.replica`) keeps its device prefix cache itself and talks
to every lower tier (host memory, a disk directory, a remote store) through a
`Tier`, in a fixed order: the first tier that continues a request's verified
chain serves the next pages, the next tier continues after it. The interface
follows MAX's `KVConnector` (lookup, load, save, flush, request complete,
reset, shutdown, metrics) in the manager's own terms:

* `lookup(query)` -> hits: the longest run of the query's pages the tier
  holds and has verified (tokens and chain; checksum or MAC for stored
  records). No side effects: the caller may drop the hits.
* `reserve(hits)`: keeps them until `load` (the host tier pins pages so the
  allocation that follows cannot evict them).
* `load(request_id, hits, pages)`: fills fresh device `pages` with them; the
  copies may land later, but before `sync()` (or `request_complete`) returns.
* `save(pages)`: takes device pages at the tier's `saves_on` moment: on
  commit (write-through: disk, remote) or on eviction (the host victim cache).
* `sync()`: every load has landed (the manager calls it before
  `runtime_inputs` returns). `flush()`: every save is durable.
* `request_complete(request_id)`: the request's loads have landed, so its
  pages may be freed.
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
    """When a tier takes copies of device pages."""

    COMMIT = "commit"
    """Write-through: every page the moment it enters the device prefix cache."""
    EVICT = "evict"
    """Victim cache: a cached page just before the device pool hands it out again."""


@dataclass(frozen=True)
class PrefixQuery:
    """A request's next full pages, after those the device already serves.

    Attributes:
        request_id: The request asking.
        hashes: The pages' 64-bit chained hashes (device and host index keys).
        tokens: Their tokens, `[len(hashes), page_size]`.
        parent_uid: `uid` of the page before them (the per-process chain), or
            None when that page is itself a lower tier's hit, not yet loaded:
            then only key-chained tiers can continue the chain.
        keys: Their cryptographic chained keys (`keys.PageKeyer`), the
            cross-process chain; empty when no tier needs them.
        parent_key: Key of the page before them.
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
class PageToSave:
    """A device page a tier may copy, with its cross-process identity."""

    page: int
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
    hit_pages: int = 0
    """Pages loaded into device pages from this tier."""
    hit_bytes: int = 0
    load_seconds: float = 0.0
    """Wall time spent reading and verifying hits (lookups included)."""
    saved_pages: int = 0
    """Pages copied into this tier."""
    saved_bytes: int = 0
    save_seconds: float = 0.0
    """Writer time spent encoding and writing saved pages."""
    rejected_pages: int = 0
    """Stored pages that failed verification (corrupt, foreign, mismatched, bad MAC): misses."""
    unauthenticated_pages: int = 0
    """Of `rejected_pages`, those whose MAC did not verify under this process's key."""
    dropped_saves: int = 0
    """Saves given up (writer backlog full, tier disabled or unreachable)."""
    errors: int = 0
    """I/O or connection failures, each served as a miss."""


@runtime_checkable
class Tier(Protocol):
    """A tier below one replica's device pool (see the module docstring)."""

    name: str
    """Short tier name for metrics and messages: "host", "disk", "remote"."""
    saves_on: SavePoint
    needs_keys: bool
    """Whether lookups need `PrefixQuery.keys` (the cross-process chain)."""
    metrics: TierMetrics

    def lookup(self, query: PrefixQuery) -> Sequence[object]:
        """Verified hits for a prefix of `query`'s pages, one opaque item per page."""
        ...

    def reserve(self, hits: Sequence[object]) -> None:
        """Keeps `hits` available until `load` takes them."""
        ...

    def load(self, request_id: Hashable, hits: Sequence[object], pages: Sequence[int]) -> list[int]:
        """Fills device `pages` with `hits`; returns the uid each page keeps
        (`NO_UID`: the replica gives it a fresh one)."""
        ...

    def save(self, pages: Sequence[PageToSave]) -> int:
        """Copies device pages into the tier (at its `saves_on` moment);
        returns how many it copied."""
        ...

    def sync(self) -> None:
        """Returns once every load's copies have landed in device memory."""
        ...

    def flush(self) -> None:
        """Returns once every save is stored (written, sent)."""
        ...

    def request_complete(self, request_id: Hashable) -> None:
        """Returns once the request's loads have landed, so its pages may be freed."""
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

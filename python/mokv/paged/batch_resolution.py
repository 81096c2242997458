"""Which replica holds each request (routing by replica index), and a batch's
context objects resolved to their requests' states.

A batch entry may be mokv's `TextContext` or MAX's own (adapted by
`mokv.context.cache_context`). A serving loop passes the same objects to
`runtime_inputs`, `step` and again next step, so the last resolution of each
replica's batch is remembered and reused while no request is claimed,
released or given a new context object (`BatchResolver.version`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from operator import is_

from ..context import TextContext, cache_context, check_same_tokens
from ..validation import check_int, check_request_id, check_sequence, check_unique
from .page_table import TableRows, table_rows
from .replica import Replica
from .request_state import BatchEntry


@dataclass(eq=False, slots=True)
class ResolvedBatch:
    """One replica's batch with each entry's context and request state."""

    version: int
    """The resolver's `version` it was resolved at."""
    objects: list[object]
    """The context objects passed, in order."""
    entries: list[BatchEntry]
    """Each entry's context (adapted) and request state, in order."""
    known: bool
    """Whether each context object is the one last passed for its request (else
    `step` records the new ones)."""
    rows: TableRows
    """The entries' page-table rows."""


class BatchResolver:
    """The manager's claims (request -> replica) and its batch resolutions.

    Args:
        replicas: The manager's replicas, by index.
    """

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = list(replicas)
        self.replica_of: dict[Hashable, Replica] = {}
        self.version = 0
        """Bumped whenever a request is claimed or released or takes a new context
        object: what a remembered resolution depends on."""
        self._resolved: list[ResolvedBatch | None] = [None for _ in replicas]
        """Per replica, the last batch resolved on the fast path."""

    def replica(self, replica_idx: int) -> Replica:
        """Replica `replica_idx`, checked."""
        if type(replica_idx) is not int:
            replica_idx = check_int("replica_idx", replica_idx)
        if not 0 <= replica_idx < len(self.replicas):
            raise ValueError(f"replica_idx={replica_idx} is out of range: there are {len(self.replicas)} replicas")
        return self.replicas[replica_idx]

    def claimed_on(self, request_id: Hashable, replica_idx: int) -> Replica:
        """The replica holding `request_id`, which must be `replica_idx`."""
        replica = self.replica(replica_idx)
        check_request_id(request_id)
        if self.replica_of.get(request_id) is not replica:
            raise ValueError(f"request {request_id!r} is {self.where(request_id)}, not on replica {replica_idx}")
        return replica

    def check_batches(self, batches: Sequence[Sequence[object]], max_batch_size: int) -> None:
        """One batch per replica, each a list of at most `max_batch_size` entries."""
        if type(batches) is not list and type(batches) is not tuple:
            check_sequence("batches", batches)
        if len(batches) != len(self.replicas):
            raise ValueError(f"expected one batch per replica ({len(self.replicas)}), got {len(batches)}")
        for replica, batch in zip(self.replicas, batches, strict=True):
            if type(batch) is not list and type(batch) is not tuple:
                check_sequence(f"batches[{replica.index}]", batch)
            if len(batch) > max_batch_size:
                raise ValueError(
                    f"replica {replica.index} batch has {len(batch)} requests, max_batch_size is {max_batch_size}"
                )

    def add(self, request_id: Hashable, replica: Replica) -> None:
        """Records that `replica` now holds `request_id`."""
        self.replica_of[request_id] = replica
        self.version += 1

    def remove(self, request_id: Hashable) -> None:
        """Forgets a released request."""
        del self.replica_of[request_id]
        self.version += 1

    def where(self, request_id: Hashable) -> str:
        """Where `request_id` is, for error messages."""
        owner = self.replica_of.get(request_id)
        return "not claimed" if owner is None else f"claimed on replica {owner.index}"

    def live(self, data: object, replica: Replica) -> BatchEntry:
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
            raise ValueError(f"request {request_id!r} is {self.where(request_id)}, not on replica {replica.index}")
        if state.source is not data and not state.is_dummy:
            check_same_tokens(state.context, ctx)
        return ctx, state

    def live_batch(self, batch: Sequence[object], replica: Replica) -> ResolvedBatch:
        """`live` for each entry of one replica's batch, none twice. The common
        case (a mokv `TextContext` passed before) takes a few operations; anything
        else goes through `live`, which raises with the reason or accepts it.

        The same objects as last time, with no request claimed, released or
        given a new context object since, resolve as last time (the caller must
        not modify the result)."""
        resolved = self._resolved[replica.index]
        if (
            resolved is not None
            and resolved.version == self.version
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
                    ctx, state = self.live(data, replica)
                    all_known = False
                entries.append((ctx, state))
        except TypeError:
            for data in batch:  # an unhashable request id: name it
                self.live(data, replica)
            raise
        if len({id(state) for _, state in entries}) != len(entries):
            check_unique("request", (ctx.request_id for ctx, _ in entries))
        rows = table_rows([state.row for _, state in entries])
        resolved = ResolvedBatch(self.version, list(batch), entries, all_known, rows)
        if all_known:  # the entries stay these objects' states until the version moves
            self._resolved[replica.index] = resolved
        return resolved


def due_entries(entries: list[BatchEntry], page_size: int) -> list[BatchEntry]:
    """The entries of a replica's batch with newly full pages to commit.

    Checks each request first: no token processed without a page for it.
    A decode step commits nothing for most requests, so the common case is
    one comparison per request (`RequestState.due_at`); only a request at
    a page boundary (or a refused one) looks further.
    """
    due = [(ctx, state) for ctx, state in entries if ctx.processed_length >= state.due_at]
    for ctx, state in due:
        if ctx.processed_length > state.num_pages * page_size and not state.is_dummy:
            raise ValueError(
                f"request {ctx.request_id!r} has processed_length {ctx.processed_length} but "
                f"its pages hold only {state.num_pages * page_size} tokens: call alloc before running it"
            )
    if due:
        due = [(ctx, state) for ctx, state in due if not state.is_dummy and not state.chain_broken]
    return due

"""The paged manager's public API as a hypothesis state machine.

Every rule is a legal call of a careful caller (claim, alloc with 1..3 steps,
runtime_inputs followed by the "model" writing a marker per token, update,
step, release, reserve, alloc_dummy, reset_prefix_cache, metrics) across page
sizes 1, 2, 16 and 128, one or two replicas, prefix caching and the host tier
on and off. After every rule the invariants are checked against what the
machine itself tracked:

* free + used == total on every replica, and each page's reference count is
  exactly the number of live requests whose pages include it;
* every prefix-cached page holds, in its KV, the markers of exactly the
  tokens its hash was computed from (and the hash is that prefix's hash);
* every processed token of every live request has its marker in the page its
  request's table names: what a request wrote, or reused from the prefix cache
  or the host tier, survives until release;
* the metrics count exactly the tokens the machine saw computed and reused.

`runtime_inputs` is also checked row by row: cache lengths, lookup-table rows
that reference only the request's own pages then the null page, max lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from mokv import InsufficientBlocksError, TextContext
from mokv.paged import BatchCharacteristics
from tests.support import kv_markers
from tests.support.machine_base import ManagerMachine
from tests.support.manager_state import paged_snapshot
from tests.support.small_cache import small_paged_manager

_BASES = [np.random.default_rng(k).integers(0, 3, size=400) for k in range(3)]
"""Shared prompt heads, so requests hit each other's cached prefixes."""


@dataclass
class Request:
    ctx: TextContext
    replica: int
    dummy: bool = False
    ran: bool = False
    """Its active tokens went through the model (markers written) since its last update."""


class PagedManagerMachine(ManagerMachine):
    NAME = "paged manager"

    def __init__(self) -> None:
        super().__init__()
        self.prefixes: dict[int, np.ndarray] = {}
        """Chained hash of every full page the model wrote -> the prefix it ends."""
        self.input_tokens = 0
        self.cache_tokens = 0

    # ----------------------------------------------------------------- set-up

    @initialize(
        page_size=st.sampled_from([1, 2, 16, 128]),
        replicas=st.sampled_from([1, 2]),
        prefix_caching=st.booleans(),
        host_tier=st.booleans(),
        pages=st.integers(3, 24),
    )
    def build(self, page_size: int, replicas: int, prefix_caching: bool, host_tier: bool, pages: int) -> None:
        self.m = small_paged_manager(
            page_size,
            pages,
            prefix_caching=prefix_caching,
            data_parallel_degree=replicas,
            total_num_host_pages=4 if prefix_caching and host_tier else 0,
            max_batch_size=4,
            checks=False,
        )
        self.ps = page_size

    def page_tensor(self, replica: int) -> np.ndarray:
        return self.m.get_device_buffer(replica).values[0].to_numpy()

    def ready(self, r: Request) -> bool:
        """Holds pages for its whole window (runtime_inputs will accept it)."""
        return r.dummy or len(self.m.get_req_blocks(r.ctx.request_id, r.replica)) * self.ps >= r.ctx.current_length

    def prompt(self, base: int, length: int, suffix: list[int]) -> np.ndarray:
        return np.concatenate([_BASES[base][:length], np.asarray(suffix, np.int64)]).astype(np.int64)

    # ------------------------------------------------------------------ rules

    @rule(
        base=st.integers(0, 2),
        length=st.integers(1, 400),
        suffix=st.lists(st.integers(0, 3), max_size=3),
        replica=st.integers(0, 1),
        num_steps=st.integers(1, 3),
    )
    def claim_and_alloc(self, base: int, length: int, suffix: list[int], replica: int, num_steps: int) -> None:
        self._op()
        replica %= self.m.num_replicas
        length = 1 + length % (3 * self.ps + 4)
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.m.claim(rid, replica)
        self.live[rid] = Request(TextContext(rid, self.prompt(base, length, suffix)), replica)
        self._alloc(self.live[rid], num_steps)

    @precondition(lambda self: any(not r.dummy for r in self.live.values()))
    @rule(pick=st.integers(0, 1 << 16), num_steps=st.integers(1, 3))
    def alloc(self, pick: int, num_steps: int) -> None:
        self._op()
        candidates = [r for r in self.live.values() if not r.dummy]
        self._alloc(candidates[pick % len(candidates)], num_steps)

    def _alloc(self, r: Request, num_steps: int) -> None:
        rid = r.ctx.request_id
        held = self.m.get_req_blocks(rid, r.replica)
        before = (r.ctx.processed_length, r.ctx.current_length)
        try:
            self.m.alloc(r.ctx, r.replica, num_steps)
        except InsufficientBlocksError:
            assert (r.ctx.processed_length, r.ctx.current_length) == before
            assert self.m.get_req_blocks(rid, r.replica) == held
            return
        reused = r.ctx.processed_length - before[0]
        assert reused % self.ps == 0 and reused >= 0
        assert reused == 0 or (before[0] == len(held) * self.ps and r.ctx.active_length >= 1)
        self.cache_tokens += reused
        self.input_tokens += r.ctx.active_length
        pages = self.m.get_req_blocks(rid, r.replica)
        assert pages[: len(held)] == held
        assert len(pages) == max(len(held), -(-(r.ctx.current_length + num_steps - 1) // self.ps))

    @rule(picks=st.lists(st.integers(0, 1 << 16), max_size=6), num_steps=st.integers(1, 3))
    def runtime_inputs(self, picks: list[int], num_steps: int) -> None:
        """A model step's inputs, checked row by row; the model then writes a
        marker for each active token (multi-step inputs are only checked)."""
        self._op()
        batches: list[list[Request]] = [[] for _ in range(self.m.num_replicas)]
        requests = list(self.live.values())
        for pick in picks:
            if requests:
                r = requests[pick % len(requests)]
                batch = batches[r.replica]
                if self.ready(r) and r not in batch and len(batch) < self.m.max_batch_size:
                    batch.append(r)
        steps_fit = all(
            r.dummy
            or len(self.m.get_req_blocks(r.ctx.request_id, r.replica)) * self.ps >= r.ctx.current_length + num_steps - 1
            for batch in batches
            for r in batch
        )
        if not steps_fit:
            num_steps = 1
        inputs = self.m.runtime_inputs([[r.ctx for r in b] for b in batches], num_steps=num_steps)
        for replica, (batch, device) in enumerate(zip(batches, inputs.inputs, strict=True)):
            self._check_inputs(batch, device, num_steps)
            if num_steps == 1:
                self._run_model(replica, batch, device.lookup_table.to_numpy())

    def _check_inputs(self, batch: list[Request], device, num_steps: int) -> None:
        null = self.m.total_num_pages
        table = device.lookup_table.to_numpy()
        assert device.cache_lengths.to_numpy().tolist() == [r.ctx.processed_length for r in batch]
        for row, r in zip(table, batch, strict=True):
            own = self.m.get_req_blocks(r.ctx.request_id, r.replica)
            if r.dummy:
                assert (row == null).all()
                continue
            needed = -(-(r.ctx.current_length + num_steps - 1) // self.ps)
            assert row[:needed].tolist() == own[:needed]
            assert (row[needed:] == null).all()
        max_lengths = device.max_lengths.to_numpy()
        assert max_lengths.shape == (num_steps, 2)
        if batch:
            assert max_lengths[0].tolist() == [
                max(r.ctx.active_length for r in batch),
                max(r.ctx.current_length for r in batch),
            ]

    def _run_model(self, replica: int, batch: list[Request], table: np.ndarray) -> None:
        tensor = self.page_tensor(replica)
        for row, r in zip(table, batch, strict=True):
            if r.dummy:
                continue
            ctx = r.ctx
            positions = np.arange(ctx.processed_length, ctx.current_length)
            pages, offsets = row[positions // self.ps], positions % self.ps
            kv_markers.write(tensor, pages, offsets, kv_markers.markers(ctx.tokens)[positions])
            full = ctx.current_length // self.ps
            for j, page_hash in enumerate(self.m._hasher.hash_pages(ctx.tokens[: full * self.ps])):
                self.prefixes[page_hash] = ctx.tokens[: (j + 1) * self.ps].copy()
            r.ran = True

    @rule(picks=st.lists(st.integers(0, 1 << 16), max_size=6))
    def step(self, picks: list[int]) -> None:
        self._op()
        batches: list[list[TextContext]] = [[] for _ in range(self.m.num_replicas)]
        requests = list(self.live.values())
        for pick in picks:
            if requests:
                r = requests[pick % len(requests)]
                if r.ctx not in batches[r.replica] and len(batches[r.replica]) < self.m.max_batch_size:
                    batches[r.replica].append(r.ctx)
        self.m.step(batches)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def release(self, pick: int) -> None:
        self._op()
        rid = list(self.live)[pick % len(self.live)]
        r = self.live.pop(rid)
        self.m.release(rid, r.replica)
        assert not self.m.contains(rid, r.replica)

    @rule(replica=st.integers(0, 1))
    def alloc_dummy(self, replica: int) -> None:
        self._op()
        replica %= self.m.num_replicas
        rid = f"pad{self.next_id}"
        self.next_id += 1
        self.m.alloc_dummy(rid, replica)
        self.live[rid] = Request(TextContext(rid, [0]), replica, dummy=True)
        assert self.m.get_req_blocks(rid, replica) == [self.m.total_num_pages]

    @rule(base=st.integers(0, 2), lengths=st.lists(st.integers(1, 300), min_size=1, max_size=3))
    def reserve(self, base: int, lengths: list[int]) -> None:
        """A warm-up reservation: held for the scope, then every page comes back;
        a refused one changes nothing."""
        self._op()
        batches: list[list[TextContext]] = [[] for _ in range(self.m.num_replicas)]
        for i, length in enumerate(lengths):
            tokens = self.prompt(base, 1 + length % (2 * self.ps + 3), [])
            batches[i % self.m.num_replicas].append(TextContext(f"w{self.next_id}-{i}", tokens))
        self.next_id += 1
        before = paged_snapshot(self.m)
        free = [self.m.num_free_blocks(r) for r in range(self.m.num_replicas)]
        try:
            with self.m.reserve(batches):
                for replica, batch in enumerate(batches):
                    for ctx in batch:
                        assert self.m.contains(ctx.request_id, replica)
                        self.cache_tokens += ctx.processed_length
                        self.input_tokens += ctx.active_length
        except InsufficientBlocksError:
            assert paged_snapshot(self.m) == before
            return
        assert [self.m.num_free_blocks(r) for r in range(self.m.num_replicas)] == free

    @rule()
    def reset_prefix_cache(self) -> None:
        self._op()
        self.m.reset_prefix_cache()
        for replica in range(self.m.num_replicas):
            assert self.m.get_num_used_host_pages(replica) == 0

    @rule()
    def metrics(self) -> None:
        self._op()
        metrics = self.m.get_metrics_aggregated()
        assert (metrics.input_tokens, metrics.cache_tokens) == (self.input_tokens, self.cache_tokens)
        assert 0.0 <= metrics.cache_hit_rate <= 1.0

    @precondition(lambda self: any(not r.dummy and self.ready(r) for r in self.live.values()))
    @rule(extra=st.integers(0, 3))
    def batch_characteristics(self, extra: int) -> None:
        """`max_lengths` reports caller-given bounds when they cover the batch."""
        self._op()
        r = next(r for r in self.live.values() if not r.dummy and self.ready(r))
        batches = [[] for _ in range(self.m.num_replicas)]
        batches[r.replica] = [r.ctx]
        bounds = BatchCharacteristics(1 + extra, r.ctx.active_length + extra, r.ctx.current_length + extra)
        inputs = self.m.runtime_inputs(batches, batch_characteristics=bounds)
        got = inputs.inputs[r.replica].max_lengths.to_numpy()
        assert got.tolist() == [[r.ctx.active_length + extra, r.ctx.current_length + extra]]

    # ------------------------------------------------------------- invariants

    @invariant()
    def pages_are_accounted_for(self) -> None:
        if not hasattr(self, "m"):
            return
        for replica in range(self.m.num_replicas):
            holders: dict[int, int] = {}
            for r in self.live.values():
                if r.replica == replica and not r.dummy:
                    for page in self.m.get_req_blocks(r.ctx.request_id, replica):
                        holders[page] = holders.get(page, 0) + 1
            assert self.m.num_free_blocks(replica) + len(holders) == self.m.total_num_pages
            assert self.m.get_num_used_pages(replica) == len(holders)
            ref_count = self.m._replicas[replica].pool.ref_count
            assert ref_count == [holders.get(page, 0) for page in range(self.m.total_num_pages)]

    @invariant()
    def cached_pages_hold_their_tokens(self) -> None:
        if not hasattr(self, "m"):
            return
        for replica, r in enumerate(self.m._replicas):
            r.check_invariants()  # every hash is its page's tokens' hash, on both tiers
            index = r.pool.index
            committed = index.committed_pages()
            if not committed:
                continue
            tensor = self.page_tensor(replica)
            for page in committed:
                prefix = self.prefixes[index.hash[page]]  # only pages the model wrote whole get committed
                assert (prefix[-self.ps :] == index.tokens[page]).all()
                positions = np.arange(len(prefix) - self.ps, len(prefix))
                stored = kv_markers.read(tensor, np.full(self.ps, page), positions % self.ps)
                np.testing.assert_array_equal(stored, kv_markers.markers(prefix)[positions])

    @invariant()
    def processed_tokens_keep_their_markers(self) -> None:
        if not hasattr(self, "m"):
            return
        for r in self.live.values():
            n = r.ctx.processed_length
            if r.dummy or not n:
                continue
            pages = np.asarray(self.m.get_req_blocks(r.ctx.request_id, r.replica))
            positions = np.arange(n)
            stored = kv_markers.read(self.page_tensor(r.replica), pages[positions // self.ps], positions % self.ps)
            np.testing.assert_array_equal(stored, kv_markers.markers(r.ctx.tokens)[:n])

    def teardown(self) -> None:
        if hasattr(self, "m"):
            for rid, r in list(self.live.items()):
                self.m.release(rid, r.replica)
            for replica in range(self.m.num_replicas):
                assert self.m.get_num_used_pages(replica) == 0


TestPagedManagerProperties = PagedManagerMachine.TestCase

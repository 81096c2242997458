"""The continuous-batching manager's public API as a hypothesis state machine.

Rules: claim (+ alloc with 1..3 steps), runtime_inputs followed by the "model"
writing a marker per token into the request's slot, update, step, fetch,
release. Invariants after every rule: free + claimed slots == total, each
claimed request has its own slot, `fetch` reports the lengths `step` recorded,
and every processed token's marker survives in its slot until release.
No graph is compiled (`increment_cache_lengths` is covered by the unit tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession

from mokv import KVCacheParams, TextContext
from mokv.continuous import ContinuousBatchingKVCacheManager
from tests.support import kv_markers
from tests.support.machine_base import ManagerMachine

PARAMS = KVCacheParams(DType.float32, n_kv_heads=1, head_dim=2, num_layers=1)
_SESSION = InferenceSession(devices=[CPU()])


@dataclass
class Request:
    ctx: TextContext
    ran: bool = False
    recorded: int = 0
    """The cache length the last `step` including it recorded."""


class ContinuousManagerMachine(ManagerMachine):
    NAME = "continuous manager"

    @initialize(slots=st.integers(1, 6), max_seq_len=st.sampled_from([1, 4, 32, 200]))
    def build(self, slots: int, max_seq_len: int) -> None:
        self.m = ContinuousBatchingKVCacheManager(PARAMS, slots, max_seq_len, 1, [CPU()], _SESSION)

    def blocks(self) -> np.ndarray:
        return self.m.blocks[0].to_numpy()

    def pick(self, picks: list[int], where=lambda r: True) -> list[Request]:
        candidates = [r for r in self.live.values() if where(r)]
        chosen: list[Request] = []
        for p in picks:
            if candidates and candidates[p % len(candidates)] not in chosen:
                chosen.append(candidates[p % len(candidates)])
        return chosen

    def fits(self, r: Request, num_steps: int = 1) -> bool:
        return r.ctx.current_length + num_steps - 1 <= self.m.max_seq_len

    @precondition(lambda self: self.m.num_free_slots > 0)
    @rule(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=40), num_steps=st.integers(1, 3))
    def claim(self, tokens: list[int], num_steps: int) -> None:
        self._op()
        rid = f"r{self.next_id}"
        self.next_id += 1
        slot = self.m.claim(rid)
        assert slot == min(set(range(self.m.max_cache_batch_size)) - {self.m.slot_of(x) for x in self.live})
        r = Request(TextContext(rid, np.asarray(tokens, np.int64)))
        self.live[rid] = r
        self._alloc(r, num_steps)

    def _alloc(self, r: Request, num_steps: int) -> None:
        if self.fits(r, num_steps):
            self.m.alloc(r.ctx, num_steps=num_steps)
        else:
            with pytest.raises(ValueError, match="max_seq_len"):
                self.m.alloc(r.ctx, num_steps=num_steps)

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 1 << 16), max_size=4))
    def runtime_inputs(self, picks: list[int]) -> None:
        self._op()
        batch = self.pick(picks, self.fits)
        (device,) = self.m.runtime_inputs([[r.ctx for r in batch]]).inputs
        assert device.lookup_table.to_numpy().tolist() == [self.m.slot_of(r.ctx.request_id) for r in batch]
        lengths = [r.ctx.processed_length for r in batch]
        assert device.cache_lengths.to_numpy().tolist() == lengths
        assert device.is_cache_empty.item() == (not any(lengths))
        blocks = self.blocks()
        for r in batch:  # the model writes the window's KV
            positions = np.arange(r.ctx.processed_length, r.ctx.current_length)
            slots = np.full(len(positions), self.m.slot_of(r.ctx.request_id))
            values = kv_markers.markers(r.ctx.tokens)[positions]
            blocks[slots, :, 0, positions, 0, :] = values
            r.ran = True

    @rule(picks=st.lists(st.integers(0, 1 << 16), max_size=4))
    def step(self, picks: list[int]) -> None:
        self._op()
        batch = self.pick(picks, self.fits)
        self.m.step([[r.ctx for r in batch]])
        for r in batch:
            r.recorded = r.ctx.processed_length

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4))
    def fetch(self, picks: list[int]) -> None:
        self._op()
        batch = self.pick(picks)
        ((blocks, lengths, lookup, empty),) = self.m.fetch([self.m.slot_of(r.ctx.request_id) for r in batch])
        assert blocks is self.m.blocks[0]
        assert lengths.to_numpy().tolist() == [r.recorded for r in batch]
        assert lookup.to_numpy().tolist() == [self.m.slot_of(r.ctx.request_id) for r in batch]
        assert empty.item() == (not any(r.recorded for r in batch))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16))
    def release(self, pick: int) -> None:
        self._op()
        rid = list(self.live)[pick % len(self.live)]
        slot = self.m.slot_of(rid)
        del self.live[rid]
        self.m.release(rid)
        assert not self.m.contains(rid) and slot not in {self.m.slot_of(x) for x in self.live}

    @invariant()
    def slots_are_accounted_for(self) -> None:
        if not hasattr(self, "m"):
            return
        slots = [self.m.slot_of(rid) for rid in self.live]
        assert len(set(slots)) == len(slots)
        assert self.m.num_free_slots + len(slots) == self.m.max_cache_batch_size
        for rid, r in self.live.items():
            assert self.m.cache_length(rid) == r.recorded

    @invariant()
    def processed_tokens_keep_their_markers(self) -> None:
        if not hasattr(self, "m"):
            return
        blocks = self.blocks()
        for rid, r in self.live.items():
            n = r.ctx.processed_length
            positions = np.arange(n)
            stored = blocks[np.full(n, self.m.slot_of(rid)), :, 0, positions, 0, :]
            np.testing.assert_array_equal(stored, kv_markers.markers(r.ctx.tokens)[:n])


TestContinuousManagerProperties = ContinuousManagerMachine.TestCase

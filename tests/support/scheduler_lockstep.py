"""MAX's own `PagedKVCacheManager` (the reference) and mokv's
`SchedulerKVCacheManager`, driven in lockstep through MAX's
`PagedKVCacheManagerInterface` the way MAX's scheduler drives it.

Each request has one MAX `TextContext` per manager (`alloc` moves a context's
window, so they cannot share one). Every operation runs on both managers and
then everything the interface exposes is compared:

- outcomes: both allocations succeed or both raise MAX's
  `InsufficientBlocksError`;
- per request: pages held, processed / active lengths, `cached_prefix_length`
  (of claimed requests: after a failed allocation MAX leaves it 0, mokv as it
  was, None on a first admission; the scheduler reads it only from requests
  in a batch);
- per replica: `block_count`, and the prefix probe for every live prompt;
- per step: the runtime inputs, field by field. Lookup tables are compared
  up to a renaming of page ids (a bijection over the step's pages, so the
  same pages are shared by the same requests), over the columns a request
  needs; past them both hold their null page (MAX pads its tables wider for
  its kernels' SIMD reads);
- metrics: cache tokens, and input tokens net of what MAX counts for
  allocations that failed (it counts them before refusing; mokv counts none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from max import tree
from max.driver import CPU
from max.engine import InferenceSession
from max.nn.kv_cache import MHAKVCacheParams
from max.pipelines.context import TextContext, TokenBuffer
from max.pipelines.kv_cache import InsufficientBlocksError
from max.pipelines.kv_cache import PagedKVCacheManager as MaxManager
from max.pipelines.modeling.types import RequestID

from mokv.pipelines.scheduler_manager import SchedulerKVCacheManager


def max_context(rid: str, tokens: np.ndarray, salt: str | None = None) -> TextContext:
    """A fresh MAX context with `tokens` as its prompt."""
    return TextContext(
        request_id=RequestID(rid), max_length=1 << 16, tokens=TokenBuffer(tokens.copy()), cache_salt=salt
    )


@dataclass
class Pair:
    """One request: its context on MAX's side and on mokv's, and its replica."""

    theirs: TextContext
    ours: TextContext
    replica: int
    tokens: np.ndarray = field(repr=False)
    salt: str | None = None


class Lockstep:
    """The two managers and their requests (see the module docstring)."""

    def __init__(self, params: MHAKVCacheParams, total_num_pages: int, max_batch_size: int) -> None:
        session = InferenceSession(devices=[CPU()])
        self.params = params
        self.total_num_pages = total_num_pages
        self.theirs = MaxManager(
            params=params, session=session, total_num_pages=total_num_pages, max_batch_size=max_batch_size
        )
        self.ours = SchedulerKVCacheManager.create(
            params, session, total_num_pages, max_batch_size=max_batch_size, enable_runtime_checks=True
        )
        self.live: dict[str, Pair] = {}
        self.failed_input_tokens = 0
        self.steps = 0
        self.hits = 0

    @property
    def managers(self) -> tuple[object, object]:
        return self.theirs, self.ours

    # ------------------------------------------------------------- operations

    def admit(self, rid: str, tokens: np.ndarray, replica: int = 0, salt: str | None = None) -> bool:
        """A new request: claim + alloc (the scheduler's CE admission). One
        that does not fit is released and reset, as the scheduler requeues it."""
        self.live[rid] = Pair(max_context(rid, tokens, salt), max_context(rid, tokens, salt), replica, tokens, salt)
        return self.alloc(rid)

    def alloc(self, rid: str) -> bool:
        """claim (if needed) + alloc on both; both succeed or both fail."""
        pair = self.live[rid]
        outcomes = []
        before = self.theirs.get_metrics_aggregated().input_tokens
        for manager, ctx in zip(self.managers, (pair.theirs, pair.ours), strict=True):
            if not manager.contains(ctx):
                manager.claim(ctx, replica_idx=pair.replica)
            try:
                manager.alloc(ctx)
                outcomes.append(True)
            except InsufficientBlocksError:
                outcomes.append(False)
        assert outcomes[0] == outcomes[1], f"{rid}: MAX ok={outcomes[0]}, mokv ok={outcomes[1]}"
        if not outcomes[0]:
            self.failed_input_tokens += self.theirs.get_metrics_aggregated().input_tokens - before
            self.preempt(rid)
        self.check()
        return outcomes[0]

    def chunk(self, rid: str, size: int) -> None:
        """Limits the request's next step to `size` tokens (the token budget's chunking)."""
        for ctx in (self.live[rid].theirs, self.live[rid].ours):
            ctx.tokens.chunk(size)

    def run(self, rids: list[str], token_of: Callable[[str], int]) -> None:
        """One model step of the batch: runtime inputs (compared), update, step."""
        batches: list[list[list[TextContext]]] = [[[] for _ in range(self.params.data_parallel_degree)] for _ in "ab"]
        for rid in rids:
            pair = self.live[rid]
            batches[0][pair.replica].append(pair.theirs)
            batches[1][pair.replica].append(pair.ours)
        theirs = self.theirs.runtime_inputs(batches[0])
        ours = self.ours.runtime_inputs(batches[1])
        self.compare_inputs(theirs, ours, batches[0])
        for rid in rids:
            for manager, ctx in zip(self.managers, (self.live[rid].theirs, self.live[rid].ours), strict=True):
                ctx.update(token_of(rid))
                manager.step(ctx)
        self.steps += 1
        self.check()

    def release(self, rid: str) -> None:
        """The request finished (or was cancelled): both release it."""
        pair = self.live.pop(rid)
        for manager, ctx in zip(self.managers, (pair.theirs, pair.ours), strict=True):
            manager.release(ctx)
        self.check()

    def preempt(self, rid: str) -> None:
        """The scheduler's preemption: release and reset the context to a new
        prompt of all its tokens; it is admitted again later with `alloc`."""
        pair = self.live[rid]
        for manager, ctx in zip(self.managers, (pair.theirs, pair.ours), strict=True):
            if manager.contains(ctx):
                manager.release(ctx)
            ctx.reset()

    def take_metrics(self) -> tuple[object, object]:
        """Both managers' metric windows (MAX's `take_metrics_aggregated`); a new window starts."""
        self.failed_input_tokens = 0
        return self.theirs.take_metrics_aggregated(), self.ours.take_metrics_aggregated()

    # ------------------------------------------------------------- comparisons

    def check(self) -> None:
        """Everything but the runtime inputs (see the module docstring)."""
        for replica in range(self.params.data_parallel_degree):
            assert self.theirs.block_count(replica) == self.ours.block_count(replica), replica
        for rid, pair in self.live.items():
            a, b = pair.theirs, pair.ours
            assert self.theirs.contains(a) == self.ours.contains(b), rid
            if self.theirs.contains(a):
                assert self.theirs.num_req_blocks(a) == self.ours.num_req_blocks(b), rid
                assert a.cached_prefix_length == b.cached_prefix_length, rid
                self.hits += bool(a.cached_prefix_length)
            assert (a.tokens.processed_length, a.tokens.active_length) == (
                b.tokens.processed_length,
                b.tokens.active_length,
            ), rid
            probe = max_context(f"probe-{rid}", pair.tokens, pair.salt)
            assert self.theirs.get_prefix_cache_hit_counts(probe) == self.ours.get_prefix_cache_hit_counts(probe), rid
        theirs, ours = self.theirs.get_metrics_aggregated(), self.ours.get_metrics_aggregated()
        assert theirs.cache_tokens == ours.cache_tokens
        assert theirs.input_tokens - self.failed_input_tokens == ours.input_tokens

    def compare_inputs(self, theirs: tuple, ours: tuple, batches: list[list[TextContext]]) -> None:
        """The runtime inputs of one step, device by device (see the module docstring)."""
        assert len(theirs) == len(ours)
        for replica, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            for name in ("cache_lengths", "max_prompt_length", "max_cache_length", "page_stride"):
                assert np.array_equal(getattr(a, name).to_numpy(), getattr(b, name).to_numpy()), name
            assert np.array_equal(a.attention_dispatch_metadata.to_numpy(), b.attention_dispatch_metadata.to_numpy())
            assert a.kv_blocks.shape == b.kv_blocks.shape
            assert (a.kv_scales is None) == (b.kv_scales is None)
            if a.kv_scales is not None:
                assert (a.kv_scales.shape, a.kv_scales.dtype) == (b.kv_scales.shape, b.kv_scales.dtype)
            leaves_a, leaves_b = tree.leaves(a), tree.leaves(b)
            assert len(leaves_a) == len(leaves_b)
            self._compare_tables(a.lookup_table.to_numpy(), b.lookup_table.to_numpy(), batches[replica])

    def _compare_tables(self, theirs: np.ndarray, ours: np.ndarray, batch: list[TextContext]) -> None:
        null = self.total_num_pages
        ps = self.params.page_size
        assert theirs.shape[0] == ours.shape[0] == len(batch)
        renaming: dict[int, int] = {}
        for row, ctx in enumerate(batch):
            needed = -(-ctx.tokens.current_position // ps)
            assert (theirs[row, needed:] == null).all() and (ours[row, needed:] == null).all()
            for page_theirs, page_ours in zip(theirs[row, :needed], ours[row, :needed], strict=True):
                assert renaming.setdefault(int(page_theirs), int(page_ours)) == page_ours
        assert len(set(renaming.values())) == len(renaming), "two MAX pages renamed to one mokv page"

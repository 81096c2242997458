"""Continuous batching over mokv's paged cache.

Every `step()` builds one ragged batch under a token budget: running decodes
first (one token each), then prefills (chunked when they don't fit), then new
requests while the budget and free pages allow. When a decode needs a page and
none is free, the youngest running request is preempted: its pages are
released and it is requeued with its whole history as prompt (with prefix
caching on, most of that history comes straight back from the cache).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from mokv import InsufficientBlocksError, TextContext
from mokv_examples.logprobs import TokenLogprob, token_logprobs


class CacheInputs(Protocol):
    """A manager's graph inputs for one step."""

    def flatten(self) -> list[Any]: ...


class RequestContext(Protocol):
    """What the scheduler reads and advances of a request's context (mokv's `TextContext`)."""

    @property
    def request_id(self) -> Hashable: ...

    @property
    def processed_length(self) -> int: ...

    @property
    def active_length(self) -> int: ...

    @property
    def next_tokens(self) -> npt.NDArray[np.int64]: ...

    def update(self, token: int) -> None: ...

    def skip_processing(self, n: int) -> None: ...


class CacheManager(Protocol):
    """The manager calls the scheduler makes: mokv's `PagedKVCacheManager`, or an adapter
    with the same calls over another cache (`mokv_reference.max_cache`)."""

    total_num_pages: int
    max_batch_size: int

    def claim(self, request_id: Hashable) -> None: ...

    def alloc(self, ctx: Any) -> None: ...

    def release(self, request_id: Hashable) -> None: ...

    def runtime_inputs_for_leaf(self, batches: Sequence[Sequence[Any]]) -> CacheInputs: ...

    def step(self, batches: Sequence[Sequence[Any]]) -> None: ...

    def get_num_used_pages(self) -> int: ...

    def shutdown(self) -> None: ...


ModelStep = Callable[
    [npt.NDArray[np.int64], npt.NDArray[np.uint32], npt.NDArray[np.int64], CacheInputs],
    npt.NDArray[np.float32],
]
"""(tokens, input_row_offsets, positions, cache inputs) -> last-token logits `[batch, vocab]`."""

ContextFactory = Callable[[str, npt.NDArray[np.int64], str | None], RequestContext]
"""(request id, tokens, cache salt) -> a context the manager accepts; `mokv_context` by default."""


def mokv_context(request_id: str, tokens: npt.NDArray[np.int64], cache_salt: str | None) -> TextContext:
    """mokv's own `TextContext`: what `PagedKVCacheManager` reads."""
    return TextContext(request_id, tokens, cache_salt=cache_salt)


@dataclass
class Request:
    """One prompt to complete, and what has been generated for it so far."""

    request_id: str
    prompt: npt.NDArray[np.int64]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    preemptions: int = 0
    context: RequestContext | None = None
    cache_salt: str | None = None
    """Shares cached KV only with requests of the same salt (a tenant, say)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Each generated token's log-probability and top alternatives (when the scheduler
    was asked for them)."""
    submitted_at: float | None = None
    """`time.perf_counter()` when the request was added to a scheduler."""
    first_token_at: float | None = None
    """`time.perf_counter()` when its first token was produced."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.prompt = np.asarray(self.prompt, np.int64)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from submission to the first generated token."""
        if self.submitted_at is None or self.first_token_at is None:
            return None
        return self.first_token_at - self.submitted_at

    def fresh_context(self, new_context: ContextFactory = mokv_context) -> RequestContext:
        """A context over the prompt plus everything generated (for (re)admission)."""
        history = np.concatenate([self.prompt, np.asarray(self.generated, np.int64)])
        return new_context(self.request_id, history, self.cache_salt)


@dataclass
class StepStats:
    """Counters a run accumulates, for the closing summary."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    preemptions: int = 0
    peak_pages_used: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Sampler:
    """Greedy at temperature 0, else softmax sampling with a seeded generator."""

    def __init__(self, temperature: float = 0.0, seed: int = 0) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        if self.temperature == 0:
            return np.argmax(logits, axis=-1)
        scaled = logits / self.temperature
        probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        cumulative = probs.cumsum(axis=-1)
        draws = self.rng.random((len(logits), 1))
        return np.minimum((cumulative < draws).sum(axis=-1), logits.shape[-1] - 1)


class Scheduler:
    """Drives a model step function and a `PagedKVCacheManager` (replica 0).

    With `logprobs` > 0, every generated token's log-probability and its `logprobs` most
    likely alternatives are recorded on its request.
    """

    def __init__(
        self,
        manager: CacheManager,
        model_step: ModelStep,
        *,
        token_budget: int = 512,
        max_batch_size: int | None = None,
        sampler: Sampler | None = None,
        stop_token_ids: Sequence[int] = (),
        new_context: ContextFactory = mokv_context,
        logprobs: int = 0,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {logprobs}")
        self.new_context = new_context
        self.logprobs = logprobs
        self.manager = manager
        self.model_step = model_step
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size or manager.max_batch_size
        self.sampler = sampler or Sampler()
        self.stop_token_ids = frozenset(stop_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the youngest
        self.stats = StepStats()
        self._on_step: Callable[[Scheduler], None] | None = None

    def add(self, request: Request) -> None:
        """Queues a request; it is admitted when pages and budget allow."""
        if request.submitted_at is None:
            request.submitted_at = time.perf_counter()
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- admission

    def _admit(self, request: Request) -> bool:
        """Claims and allocates pages for a waiting request; False if none fit."""
        ctx = request.fresh_context(self.new_context)
        self.manager.claim(ctx.request_id)
        try:
            self.manager.alloc(ctx)
        except InsufficientBlocksError:
            self.manager.release(ctx.request_id)
            return False
        request.context = ctx
        self.running.append(request)
        return True

    def _preempt_youngest(self) -> Request:
        victim = self.running.pop()
        assert victim.context is not None
        self.manager.release(victim.request_id)
        victim.context = None
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _grow_running(self) -> None:
        """Gives every running request pages for its next tokens, preempting
        the youngest requests while pages are short."""
        i = 0
        while i < len(self.running):
            request = self.running[i]
            assert request.context is not None
            try:
                self.manager.alloc(request.context)
                i += 1
            except InsufficientBlocksError:
                if self._preempt_youngest() is request:
                    continue  # it was the youngest itself; the rest are served
                if len(self.running) == 0:
                    raise

    # ------------------------------------------------------------------- step

    def step(self) -> list[tuple[Request, int]]:
        """Runs one batch; returns the (request, token) pairs generated by it."""
        self._grow_running()
        while (
            self.waiting
            and len(self.running) < self.max_batch_size
            and self._budget_left(self.running) > 0
            and self._admit(self.waiting[0])
        ):
            self.waiting.popleft()
        if not self.running:
            if self.waiting:
                raise InsufficientBlocksError(
                    f"request {self.waiting[0].request_id!r} does not fit in an empty cache "
                    f"of {self.manager.total_num_pages} pages"
                )
            return []

        batch, chunks = self._plan_batch()
        contexts = [r.context for r in batch]
        assert all(c is not None for c in contexts)
        cache_inputs = self.manager.runtime_inputs_for_leaf([contexts])
        processed = np.array([c.processed_length for c in contexts], np.int64)
        row_offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.uint32)
        tokens = np.concatenate([c.next_tokens[:n] for c, n in zip(contexts, chunks, strict=True)])
        rows = np.repeat(np.arange(len(batch)), chunks)
        positions = processed[rows] + np.arange(len(tokens)) - row_offsets[rows].astype(np.int64)

        started = time.perf_counter()
        logits = self.model_step(tokens, row_offsets, positions, cache_inputs)
        elapsed = time.perf_counter() - started
        self._account(batch, chunks, elapsed)
        return self._advance(batch, chunks, logits)

    def _budget_left(self, requests: list[Request]) -> int:
        return self.token_budget - sum(r.context.active_length for r in requests if r.context is not None)

    def _plan_batch(self) -> tuple[list[Request], list[int]]:
        """Decodes first, then prefills, each taking what the budget leaves."""
        ordered = sorted(self.running, key=lambda r: r.context.active_length > 1)  # type: ignore[union-attr]
        batch, chunks, budget = [], [], self.token_budget
        for request in ordered:
            if budget == 0:
                break
            n = min(request.context.active_length, budget)  # type: ignore[union-attr]
            batch.append(request)
            chunks.append(n)
            budget -= n
        return batch, chunks

    def _account(self, batch: list[Request], chunks: list[int], elapsed: float) -> None:
        # A decode extends a generation by its last sampled token; a 1-token
        # prompt remainder at the end of a chunked prefill is still prefill.
        decode = sum(1 for r in batch if r.generated and r.context.active_length == 1)  # type: ignore[union-attr]
        prefill = sum(chunks) - decode
        self.stats.steps += 1
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += prefill
        # A mixed step's time is split in proportion to its tokens.
        self.stats.decode_seconds += elapsed * decode / sum(chunks)
        self.stats.prefill_seconds += elapsed * prefill / sum(chunks)
        used = self.manager.get_num_used_pages()
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, used)

    def _advance(
        self, batch: list[Request], chunks: list[int], logits: npt.NDArray[np.float32]
    ) -> list[tuple[Request, int]]:
        complete = [n == r.context.active_length for r, n in zip(batch, chunks, strict=True)]  # type: ignore[union-attr]
        rows = np.flatnonzero(complete)
        sampled = self.sampler(logits[rows]) if len(rows) else np.zeros(0, np.int64)
        scores = iter(token_logprobs(logits[rows], sampled, self.logprobs) if self.logprobs and len(rows) else ())
        produced: list[tuple[Request, int]] = []
        tokens_iter = iter(sampled)
        now = time.perf_counter()
        for request, n, whole in zip(batch, chunks, complete, strict=True):
            ctx = request.context
            assert ctx is not None
            if not whole:
                ctx.skip_processing(n)  # a prefill chunk: its KV is now cached
                continue
            token = int(next(tokens_iter))
            if request.first_token_at is None:
                request.first_token_at = now
            if self.logprobs:
                request.logprobs.append(next(scores))
            request.generated.append(token)
            ctx.update(token)
            produced.append((request, token))
            if token in self.stop_token_ids or len(request.generated) >= request.max_new_tokens:
                request.finished = True
        self.manager.step([[r.context for r in batch]])
        if self._on_step is not None:
            self._on_step(self)
        for request in [r for r in batch if r.finished]:
            self.running.remove(request)
            self.manager.release(request.request_id)
            request.context = None
        return produced

    def run(
        self,
        on_token: Callable[[Request, int], None] | None = None,
        on_step: Callable[[Scheduler], None] | None = None,
    ) -> StepStats:
        """Steps until every request has finished. `on_step` sees the scheduler
        after each model step, before finished requests' pages are released."""
        self._on_step = on_step
        while self.has_work:
            for request, token in self.step():
                if on_token is not None:
                    on_token(request, token)
        return self.stats

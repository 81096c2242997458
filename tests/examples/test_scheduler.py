"""The continuous-batching scheduler against a per-request reference loop, with
a stand-in model: next token = f(last token, its position). Any mix-up of rows,
positions or chunks changes the tokens, and the stand-in also checks each
step's cache inputs against the positions it is given. No graph is compiled,
so many configurations run in a second."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType

from mokv import KVCacheInputs, KVCacheParams, PagedKVCacheManager
from mokv_examples.scheduler import Request, Scheduler

VOCAB = 512
STOP = 7


def next_token(last_token: int, position: int) -> int:
    return (last_token * 31 + position * 17 + 3) % VOCAB


def expected_generation(prompt: np.ndarray, max_new_tokens: int) -> list[int]:
    """What one request alone must produce: the reference loop."""
    out: list[int] = []
    last, position = int(prompt[-1]), len(prompt) - 1
    while len(out) < max_new_tokens and not (out and out[-1] == STOP):
        last, position = next_token(last, position), position + 1
        out.append(last)
    return out


class StandInModel:
    """Last-token logits from `next_token`, after checking that the cache
    inputs agree with the positions: row b's first new token sits at
    `cache_lengths[b]` and its lookup row maps every page it touches."""

    def __init__(self, page_size: int, null_page: int) -> None:
        self.page_size = page_size
        self.null_page = null_page
        self.batches: list[int] = []

    def __call__(self, tokens, row_offsets, positions, inputs: KVCacheInputs) -> np.ndarray:
        (cache,) = inputs.inputs
        cache_lengths = cache.cache_lengths.to_numpy()
        lookup = cache.lookup_table.to_numpy()
        starts, ends = row_offsets[:-1].astype(int), row_offsets[1:].astype(int)
        assert (ends > starts).all(), "every scheduled row has new tokens"
        np.testing.assert_array_equal(positions[starts], cache_lengths)
        np.testing.assert_array_equal(
            np.diff(positions)[np.diff(np.repeat(np.arange(len(starts)), ends - starts)) == 0], 1
        )
        for b, end in enumerate(ends):
            pages_touched = -(-(int(positions[end - 1]) + 1) // self.page_size)
            assert (lookup[b, :pages_touched] != self.null_page).all()
        self.batches.append(len(starts))
        logits = np.zeros((len(starts), VOCAB), np.float32)
        last = ends - 1
        logits[np.arange(len(starts)), [next_token(int(tokens[i]), int(positions[i])) for i in last]] = 1.0
        return logits


@pytest.mark.parametrize(
    ("page_size", "num_pages", "token_budget", "prefix_caching"),
    [(16, 64, 512, True), (4, 12, 9, True), (4, 12, 9, False), (1, 64, 5, True), (16, 6, 16, False)],
)
def test_every_request_matches_its_reference_loop(page_size, num_pages, token_budget, prefix_caching):
    rng = np.random.default_rng(page_size * 100 + num_pages)
    # Up to 12 shared + 20 own prompt tokens and 11 new ones: every request
    # fits the cache alone, but not all of them at once.
    shared = rng.integers(8, VOCAB, 12)
    prompts = [
        np.concatenate([shared[: rng.integers(0, 13)], rng.integers(8, VOCAB, rng.integers(1, 21))]) for _ in range(8)
    ]
    params = KVCacheParams(
        dtype=DType.float32,
        n_kv_heads=1,
        head_dim=8,
        num_layers=1,
        page_size=page_size,
        enable_prefix_caching=prefix_caching,
    )
    manager = PagedKVCacheManager(params, None, num_pages, max_batch_size=8, enable_runtime_checks=True)
    model = StandInModel(page_size, null_page=num_pages)
    scheduler = Scheduler(manager, model, token_budget=token_budget, stop_token_ids=[STOP])
    requests = [Request(f"r{i}", p, int(rng.integers(1, 12))) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    stats = scheduler.run()

    for request in requests:
        assert request.finished
        assert request.generated == expected_generation(request.prompt, request.max_new_tokens)
    assert manager.get_num_used_pages() == 0, "every page is released at the end"
    assert stats.peak_pages_used <= num_pages
    assert max(model.batches) > 1, "requests were batched"
    generated = sum(len(r.generated) for r in requests)
    assert stats.decode_tokens + stats.prefill_tokens >= generated


def test_tight_cache_preempts_and_recovers():
    """Six pages of 4 tokens cannot hold three growing requests at once."""
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=1, head_dim=8, num_layers=1, page_size=4)
    manager = PagedKVCacheManager(params, None, 6, max_batch_size=4, enable_runtime_checks=True)
    scheduler = Scheduler(manager, StandInModel(4, null_page=6), token_budget=64)
    prompts = [np.arange(10, 16), np.arange(20, 25), np.arange(30, 37)]
    requests = [Request(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    stats = scheduler.run()
    assert stats.preemptions > 0
    assert [r.generated for r in requests] == [expected_generation(p, 10) for p in prompts]


def test_request_larger_than_the_cache_is_refused():
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=1, head_dim=8, num_layers=1, page_size=4)
    manager = PagedKVCacheManager(params, None, 2, max_batch_size=2)
    scheduler = Scheduler(manager, StandInModel(4, null_page=2))
    scheduler.add(Request("big", np.arange(10, 30), 4))
    with pytest.raises(Exception, match="does not fit in an empty cache of 2 pages"):
        scheduler.run()


def test_logprobs_and_first_token_times_are_recorded_per_token():
    """With `logprobs=3`, every generated token carries its log-probability under the
    step's logits and the 3 likeliest tokens, the greedy choice first; every request
    has a first-token time after its submission."""
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=1, head_dim=8, num_layers=1, page_size=4)
    manager = PagedKVCacheManager(params, None, 32, max_batch_size=4, enable_runtime_checks=True)
    scheduler = Scheduler(manager, StandInModel(4, null_page=32), token_budget=8, logprobs=3)
    requests = [Request(f"r{i}", np.arange(10 + i, 20 + 2 * i), 5) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    scheduler.run()
    # The stand-in's logits are 1 for the next token and 0 elsewhere.
    chosen = float(1 - np.log(np.e + VOCAB - 1))
    for request in requests:
        assert [lp.token_id for lp in request.logprobs] == request.generated
        for lp in request.logprobs:
            assert lp.logprob == pytest.approx(chosen)
            assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, pytest.approx(chosen))
        assert request.time_to_first_token is not None and request.time_to_first_token > 0

"""The numpy attention every attention test compares against (`mokv_reference.attention`),
held to facts that do not come from it: a sequence's new tokens over its cache attend as the
same tokens do in plain causal attention over the whole sequence (`causal_attention`, one
masked softmax), a window of one returns each token's own value, a window longer than the
context changes nothing, and the chunks its scores are taken in do not show."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType

from mokv_reference import attention as reference
from mokv_reference import cache
from tests.support.attention_cases import make_batch

SCALE = 0.2


def _sequence(b, row: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Row `row`'s keys and values, every position of its context, read through the cache."""
    context = int(b.cache_lengths[row] + b.row_offsets[row + 1] - b.row_offsets[row])
    rows, positions = np.full(context, row, np.uint32), np.arange(context, dtype=np.uint32)
    return tuple(cache.gather(b.blocks, layer, kv, b.lookup_table, rows, positions) for kv in (0, 1))


def _attention(b, layer: int, window: int = 0) -> np.ndarray:
    return reference.attention(b.blocks, layer, b.q, b.row_offsets, b.cache_lengths, b.lookup_table, SCALE, window)


@pytest.mark.parametrize(("layout", "block_len"), [("paged", 16), ("paged", 1), ("continuous", 512)])
@pytest.mark.parametrize(("n_q_heads", "n_kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_new_tokens_attend_as_in_causal_attention_over_the_whole_sequence(layout, block_len, n_q_heads, n_kv_heads):
    rng = np.random.default_rng(n_q_heads * 10 + block_len)
    rows = [(0, 40), (130, 1), (75, 22), (9, 0)]
    b = make_batch(rng, layout, DType.float32, rows, n_q_heads, n_kv_heads, 16, block_len)
    out = _attention(b, 1)
    for row, (cached, new) in enumerate(rows):
        if new == 0:
            continue
        keys, values = _sequence(b, row, 1)
        queries = np.zeros((cached + new, n_q_heads, 16), np.float32)  # the cached tokens' rows are not asked
        queries[cached:] = b.q[b.row_offsets[row] : b.row_offsets[row + 1]]
        expected = reference.causal_attention(queries, keys, values, SCALE)[cached:]
        np.testing.assert_allclose(out[b.row_offsets[row] : b.row_offsets[row + 1]], expected, rtol=1e-12, atol=1e-12)


def test_a_window_of_one_returns_each_tokens_own_value():
    rng = np.random.default_rng(1)
    rows = [(50, 7), (0, 3), (200, 1)]
    b = make_batch(rng, "paged", DType.float32, rows, 6, 3, 8, 16)
    out = _attention(b, 0, window=1)
    for row, (cached, _) in enumerate(rows):
        _, values = _sequence(b, row, 0)
        own = values[cached:][:, np.arange(6) // 2]  # query head h reads KV head h // 2
        np.testing.assert_allclose(out[b.row_offsets[row] : b.row_offsets[row + 1]], own, rtol=1e-12)


def test_a_window_longer_than_the_context_changes_nothing():
    b = make_batch(np.random.default_rng(2), "paged", DType.float32, [(90, 12), (3, 1)], 4, 2, 8, 16)
    np.testing.assert_array_equal(_attention(b, 0, window=103), _attention(b, 0))


def test_the_chunks_scores_are_taken_in_do_not_show(monkeypatch):
    """A chunk of one token at a time gives what whole rows give (the default chunks here)."""
    b = make_batch(np.random.default_rng(3), "paged", DType.float32, [(300, 45), (17, 60)], 8, 2, 16, 16)
    whole, windowed = _attention(b, 0), _attention(b, 0, window=20)
    monkeypatch.setattr(reference, "SCORES_PER_CHUNK", 1)
    np.testing.assert_allclose(_attention(b, 0), whole, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(_attention(b, 0, window=20), windowed, rtol=1e-13, atol=1e-15)

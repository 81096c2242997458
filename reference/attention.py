"""Numpy model of ragged attention over the cache: what `mokv.attention` computes.

Each sequence's keys and values are read token by token through the layout
model in `cache.py`, and every query row gets a plain, fully materialised
softmax in float64, so the result is independent of the kernel's tiling,
splitting and online-softmax bookkeeping. A sequence's new tokens are scored in
chunks, one matrix product per KV head (no per-token loop: a 2k-token chunk over
8k positions is seconds, not minutes).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import cache

SCORES_PER_CHUNK = 1 << 24
"""Scores materialised at once (128 MB of float64): a row's new tokens go in chunks of as
many as fit, whole query heads over the whole context."""


def visible_range(cache_length: int, new_indices: np.ndarray, sliding_window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Positions `[start, end)` seen by each new token of `new_indices` of a sequence with
    `cache_length` tokens cached before this step: itself, everything before it, and with
    `sliding_window` W > 0 only the last W of those."""
    ends = cache_length + new_indices + 1
    starts = np.maximum(0, ends - sliding_window) if sliding_window > 0 else np.zeros_like(ends)
    return starts, ends


def attention(
    blocks: np.ndarray,
    layer: int,
    q: np.ndarray,
    row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    lookup_table: np.ndarray,
    scale: float,
    sliding_window: int = 0,
    weights_in_products: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Attention of every new token over its own sequence, in float64.

    `blocks` `[blocks, 2, layers, block_len, n_kv_heads, head_dim]` already
    holds this step's new keys and values at positions `cache_lengths[b] ..`;
    `q` is `[total_new_tokens, n_q_heads, head_dim]` with sequence b's tokens in
    rows `row_offsets[b] : row_offsets[b + 1]`; query head h reads KV head
    `h // (n_q_heads // n_kv_heads)`. Returns `[total_new_tokens, n_q_heads, head_dim]`.

    `weights_in_products`, where given, models a kernel whose weighted sum of
    values takes the softmax weights `exp(s - max)` as it rounds them (say to
    a tensor core's bfloat16), while the sum that normalises takes them as
    they are.
    """
    n_q_heads, head_dim = q.shape[1], q.shape[2]
    n_kv_heads = blocks.shape[4]
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    group = n_q_heads // n_kv_heads
    out = np.zeros(q.shape, np.float64)
    for row in range(len(cache_lengths)):
        first, last = int(row_offsets[row]), int(row_offsets[row + 1])
        if first == last:
            continue
        cached = int(cache_lengths[row])
        context = cached + last - first
        positions = np.arange(context, dtype=np.uint32)
        rows = np.full(context, row, np.uint32)
        # [KV head, position, dim], contiguous so that the products below go to BLAS: query
        # head h reads KV head h // group.
        keys, values = (
            np.ascontiguousarray(
                cache.gather(blocks, layer, kv, lookup_table, rows, positions).transpose(1, 0, 2)
            ).astype(np.float64)
            for kv in (0, 1)
        )
        tokens_per_chunk = max(1, SCORES_PER_CHUNK // (n_q_heads * context))
        for chunk in range(first, last, tokens_per_chunk):
            tokens = np.arange(chunk, min(chunk + tokens_per_chunk, last))
            starts, ends = visible_range(cached, tokens - first, sliding_window)
            seen = slice(int(starts.min()), int(ends.max()))  # what any token of the chunk sees
            span = seen.stop - seen.start
            visible = (positions[seen] >= starts[:, None]) & (positions[seen] < ends[:, None])  # [token, position]
            # [KV head, token x group, dim]: one matrix product per KV head.
            queries = q[tokens].astype(np.float64).reshape(len(tokens), n_kv_heads, group, head_dim)
            queries = queries.transpose(1, 0, 2, 3).reshape(n_kv_heads, len(tokens) * group, head_dim)
            scores = (queries @ keys[:, seen].transpose(0, 2, 1)).reshape(n_kv_heads, len(tokens), group, span) * scale
            scores = np.where(visible[None, :, None, :], scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights = weights.reshape(n_kv_heads, len(tokens) * group, span)
            sums = weights.sum(axis=-1, keepdims=True)
            if weights_in_products is None:
                products = (weights / sums) @ values[:, seen]
            else:
                products = (weights_in_products(weights) @ values[:, seen]) / sums
            products = products.reshape(n_kv_heads, len(tokens), group, head_dim).transpose(1, 0, 2, 3)
            out[tokens] = products.reshape(len(tokens), n_q_heads, head_dim)
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention of one sequence with no cache, in float64: what a graph that
    stores a whole prompt's K/V and attends over it must return.

    `q` is `[tokens, n_q_heads, head_dim]`, `k` and `v` `[tokens, n_kv_heads, head_dim]`;
    query head h reads KV head `h // (n_q_heads // n_kv_heads)`.
    """
    kv_head_of = np.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    keys, values = k[:, kv_head_of].astype(np.float64), v[:, kv_head_of].astype(np.float64)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), keys) * scale
    scores[:, np.triu(np.ones((len(q), len(k)), bool), 1)] = -np.inf
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, values)

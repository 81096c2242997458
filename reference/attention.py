"""Numpy model of ragged attention over the cache: what `mokv.attention` computes.

Each sequence's keys and values are read token by token through the layout
model in `cache.py`, and every query row gets a plain, fully materialised
softmax in float64, so the result is independent of the kernel's tiling,
splitting and online-softmax bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import cache


def visible_range(cache_length: int, new_index: int, sliding_window: int = 0) -> tuple[int, int]:
    """Positions `[start, end)` seen by new token `new_index` of a sequence with
    `cache_length` tokens cached before this step: itself, everything before it,
    and with `sliding_window` W > 0 only the last W of those."""
    end = cache_length + new_index + 1
    start = max(0, end - sliding_window) if sliding_window > 0 else 0
    return start, end


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
    n_q_heads = q.shape[1]
    n_kv_heads = blocks.shape[4]
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    kv_head_of = np.arange(n_q_heads) // (n_q_heads // n_kv_heads)
    out = np.zeros(q.shape, np.float64)
    for row in range(len(cache_lengths)):
        first, last = int(row_offsets[row]), int(row_offsets[row + 1])
        if first == last:
            continue
        context = int(cache_lengths[row]) + last - first
        positions = np.arange(context, dtype=np.uint32)
        rows = np.full(context, row, np.uint32)
        keys = cache.gather(blocks, layer, 0, lookup_table, rows, positions).astype(np.float64)
        values = cache.gather(blocks, layer, 1, lookup_table, rows, positions).astype(np.float64)
        for i in range(last - first):
            start, end = visible_range(int(cache_lengths[row]), i, sliding_window)
            k = keys[start:end, kv_head_of]  # [n, H, D]
            v = values[start:end, kv_head_of]
            scores = np.einsum("hd,nhd->hn", q[first + i].astype(np.float64), k) * scale
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            if weights_in_products is None:
                weights /= weights.sum(axis=1, keepdims=True)
                out[first + i] = np.einsum("hn,nhd->hd", weights, v)
            else:
                products = np.einsum("hn,nhd->hd", weights_in_products(weights), v)
                out[first + i] = products / weights.sum(axis=1)[:, None]
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

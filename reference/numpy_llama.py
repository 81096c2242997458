"""A plain numpy Llama forward pass: the independent reference for the MAX model graphs.

Deliberately written the other way round from ``mokv_models.llama`` wherever that is possible,
so the two cannot share a mistake:

* float64 throughout (the graph is float32);
* llama.cpp's RoPE convention: it first re-applies the converter's per-head Q/K row permutation
  (undoing ``mokv_models.gguf_model``'s un-permutation, i.e. back to the GGUF's own order) and
  then rotates *adjacent* pairs ``(2i, 2i+1)``, as ggml's default RoPE mode does, with angles
  computed in place rather than from a table;
* one sequence at a time, with an explicit upper-triangular mask and ``np.repeat`` for
  grouped-query heads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mokv_models.gguf_model import LlamaCheckpoint


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The GGUF converter's ``permute``: Hugging Face Q/K rows -> llama.cpp's interleaved order."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_adjacent_pairs(x: np.ndarray, base: float) -> np.ndarray:
    """Rotate pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` ``[T, heads, D]`` by ``pos * base^(-2i/D)``."""
    t, _, d = x.shape
    theta = np.arange(t, dtype=np.float64)[:, None] * base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


KVStore = Callable[[int, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``(layer, keys, values) -> (keys, values)``: what a cache hands back of the keys (after RoPE)
and values ``[T, kv_heads, head_dim]`` it was given, in llama.cpp's channel order."""


def numpy_llama_logits(checkpoint: LlamaCheckpoint, tokens: np.ndarray, kv_store: KVStore | None = None) -> np.ndarray:
    """Logits ``[T, vocab]`` (float64) of every position of one sequence starting at position 0.

    ``kv_store`` models a lossy cache (e.g. 8-bit storage): attention reads the keys and values
    it returns instead of the exact ones."""
    c = checkpoint.config
    w = checkpoint.weights

    def weight(name: str) -> np.ndarray:
        return np.asarray(w[name], dtype=np.float64)

    t = len(tokens)
    group = c.n_heads // c.n_kv_heads
    causal = np.triu(np.full((t, t), -np.inf), k=1)
    h = weight("token_embd.weight")[np.asarray(tokens)]
    for i in range(c.n_layers):
        p = f"blk.{i}."
        x = _rms_norm(h, weight(p + "attn_norm.weight"), c.rms_norm_eps)
        wq = llama_cpp_permute(weight(p + "attn_q.weight"), c.n_heads)
        wk = llama_cpp_permute(weight(p + "attn_k.weight"), c.n_kv_heads)
        q = _rope_adjacent_pairs((x @ wq.T).reshape(t, c.n_heads, c.head_dim), c.rope_base)
        k = _rope_adjacent_pairs((x @ wk.T).reshape(t, c.n_kv_heads, c.head_dim), c.rope_base)
        v = (x @ weight(p + "attn_v.weight").T).reshape(t, c.n_kv_heads, c.head_dim)
        if kv_store is not None:
            k, v = kv_store(i, k, v)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head h uses kv h // group
        # [heads, T, T] scores as batched matrix products (BLAS: an einsum took minutes at 2k tokens)
        scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0) / np.sqrt(c.head_dim) + causal
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = (probs @ v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(t, c.hidden_size)
        h = h + attn @ weight(p + "attn_output.weight").T
        x = _rms_norm(h, weight(p + "ffn_norm.weight"), c.rms_norm_eps)
        gate, up = x @ weight(p + "ffn_gate.weight").T, x @ weight(p + "ffn_up.weight").T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ weight(p + "ffn_down.weight").T
    h = _rms_norm(h, weight("output_norm.weight"), c.rms_norm_eps)
    return h @ weight(c.lm_head_name).T

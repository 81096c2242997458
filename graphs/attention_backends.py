"""How a Llama graph's attention is plugged in, and the cache-free reference backend.

The decoder graph (``mokv_models.llama``) computes Q, K and V for a ragged batch, applies RoPE,
and hands them to an :class:`AttentionBackend`. A backend may declare extra graph inputs (a
paged KV cache declares its page tensor, cache lengths and lookup table); the graph appends them
after its own inputs and passes them back on every call. Swapping the backend is the only
difference between a cache-free graph and a paged-cache one, which is what lets the two be
compared token for token.

:class:`DenseCausalAttention` is the reference: no cache, plain MAX ops, exact softmax
attention of every token over the earlier tokens of its own sequence. With it, a decode step is
a full recomputation of every sequence from its first token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from max.dtype import DType
from max.graph import BufferType, Dim, TensorType, TensorValue, Value, ops


class AttentionBackend(Protocol):
    """Attention over a ragged batch, after RoPE.

    Shapes (``T`` = total tokens of the batch, ``B`` = number of sequences):

    * ``q``: ``[T, n_heads, head_dim]``; ``k``, ``v``: ``[T, n_kv_heads, head_dim]`` float32,
      tokens of sequence ``b`` in rows ``input_row_offsets[b]:input_row_offsets[b + 1]``;
      query head ``h`` attends with KV head ``h // (n_heads // n_kv_heads)`` (grouped-query).
    * ``input_row_offsets``: ``[B + 1]`` uint32, starts at 0, non-decreasing.
    * ``graph_inputs``: the graph values of :meth:`input_types`, in that order.
    * returns ``[T, n_heads, head_dim]`` float32: each token's attention output.
    """

    @property
    def custom_extensions(self) -> list[Path]:
        """Kernel packages the graph must load for this backend's custom ops."""
        ...

    def input_types(self) -> list[TensorType | BufferType]:
        """Extra graph inputs this backend needs, appended after the model's own inputs."""
        ...

    def __call__(
        self,
        layer_idx: int,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        input_row_offsets: TensorValue,
        graph_inputs: Sequence[Value],
    ) -> TensorValue:
        """Attention output of layer ``layer_idx`` for this step's tokens."""
        ...


def _same_sequence_causal_mask(input_row_offsets: TensorValue, total_tokens: Dim) -> TensorValue:
    """``[T, T]`` bool: query ``i`` may see key ``j`` iff ``start(i) <= j <= i``.

    ``start(i)`` is the first row of ``i``'s sequence: the largest ``input_row_offsets[b]``
    (``b < B``) not above ``i``. Keys at or before ``i`` and at or after that start lie in
    ``i``'s own sequence, so this is the block-diagonal causal mask of the ragged batch.
    """
    device = input_row_offsets.device
    rows = ops.range(0, total_tokens, 1, out_dim=total_tokens, dtype=DType.int64, device=device)
    starts = ops.cast(input_row_offsets[:-1], DType.int64)  # [B]
    rows_col = ops.unsqueeze(rows, 1)  # [T, 1]
    starts_row = ops.unsqueeze(starts, 0)  # [1, B]
    candidate = ops.where(starts_row <= rows_col, starts_row, ops.constant(0, DType.int64, device))
    seq_start = ops.max(candidate, axis=1)  # [T, 1]
    keys = ops.unsqueeze(rows, 0)  # [1, T]
    return ops.logical_and(keys >= seq_start, keys <= rows_col)


def _softmax(x: TensorValue) -> TensorValue:
    """Softmax over the last axis spelled out as max/exp/sum, not ``ops.softmax``.

    MAX 26.7 on CPU computed ``ops.softmax(where(mask, s, -inf)) @ v`` as if the mask were
    absent in some graphs: this attention alone and the 1-layer model attended to future tokens
    and across sequences, while the 2- and 30-layer models, and the same ops with the
    probabilities also returned as a graph output, were right (presumably a fused-attention
    rewrite that drops the ``where``). The spelled-out form matched numpy in every graph tried.
    Every row keeps its diagonal, so the max is finite.
    """
    e = ops.exp(x - ops.max(x, axis=-1))
    return e / ops.sum(e, axis=-1)


class DenseCausalAttention:
    """Exact causal attention within each sequence of the ragged batch, with no KV cache.

    Needs no graph inputs beyond the model's. Memory and time are quadratic in the batch's
    total tokens (one ``[n_heads, T, T]`` score tensor per layer, masked block-diagonally), which
    is the price of being simple enough to serve as the reference for cached backends.
    """

    @property
    def custom_extensions(self) -> list[Path]:
        return []

    def input_types(self) -> list[TensorType | BufferType]:
        return []

    def __call__(
        self,
        layer_idx: int,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        input_row_offsets: TensorValue,
        graph_inputs: Sequence[Value],
    ) -> TensorValue:
        total, n_heads, head_dim = q.shape
        n_kv_heads = k.shape[1]
        group = int(n_heads) // int(n_kv_heads)
        # Group query heads under their KV head: [KV, G*T, D] against K^T [KV, D, T].
        q_grouped = ops.reshape(
            ops.permute(ops.reshape(q, [total, n_kv_heads, group, head_dim]), [1, 2, 0, 3]),
            [n_kv_heads, group * total, head_dim],
        )
        scores = ops.matmul(q_grouped, ops.permute(k, [1, 2, 0])) * (1.0 / math.sqrt(int(head_dim)))
        scores = ops.reshape(scores, [n_kv_heads, group, total, total])
        mask = _same_sequence_causal_mask(input_row_offsets, total)
        neg_inf = ops.constant(float("-inf"), DType.float32, q.device)
        probs = _softmax(ops.where(mask, scores, neg_inf))
        out = ops.matmul(
            ops.reshape(probs, [n_kv_heads, group * total, total]), ops.permute(v, [1, 0, 2])
        )  # [KV, G*T, D]
        out = ops.permute(ops.reshape(out, [n_kv_heads, group, total, head_dim]), [2, 0, 1, 3])
        return ops.reshape(out, [total, n_heads, head_dim])

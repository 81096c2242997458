"""MAX's `max.nn` attention layers on mokv's ops.

`MokvAttentionWithRope` and `MokvGGUFQAttentionWithRope` are MAX 26.7's
`AttentionWithRope` and `GGUFQAttentionWithRope` (the classes MAX's Llama
picks for float32 / bfloat16 weights and for the GGUF encodings q4_0, q4_k,
q6_k) with only `__call__` replaced: the same weights under the same names,
the same projections (MAX's `StackedLinear`, `Linear`, `ops.qmatmul`), the same
sharding, and RoPE computed from MAX's own `freqs_cis` table. What changes is
the cache work: `mokv.graph.store_kv` writes the roped keys and the values and
`mokv.graph.attention` attends over them, in place of MAX's fused
rope-split-store and flash-attention kernels.

RoPE: new token i of row b sits at position `cache_lengths[b] + i`, the
position MAX's kernels rotate it by; its row of `freqs_cis` (`[head_dim]`,
interleaved (cos, sin) pairs) rotates query and key heads as MAX's
`RotaryEmbedding` does, pairs `(2j, 2j + 1)` when `rope.interleaved`, else the
halves `(j, j + head_dim / 2)`.

A layer takes MAX's cache values (`max.nn.kv_cache.PagedCacheValues`) as MAX's
layers do. The layers of one forward get the same values, table and offsets
objects, so the first prepares a `CacheStep` (the mapping of the cache,
`mokv.pipelines.cache_values`, and the gather of the tokens' rotary rows) and
the others in the same graph reuse it. `to_mokv` turns a built MAX layer into
its mokv twin in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from max.dtype import DType
from max.graph import DeviceRef, DimLike, Graph, TensorValue, ops
from max.nn.attention import AttentionWithRope, GGUFQAttentionWithRope
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kv_cache import KVCacheInputsPerDevice
from max.nn.layer import Module

from ..graph import PagedCacheValues, attention, store_kv
from .cache_values import mokv_cache_values


def token_positions(input_row_offsets: TensorValue, cache_lengths: TensorValue, total_tokens: DimLike) -> TensorValue:
    """Each new token's position in its sequence, int64 `[total_tokens]` on the
    host: `cache_lengths[b] + i` for token i of row b (rows delimited by the
    uint32 `[batch + 1]` `input_row_offsets`)."""
    host = DeviceRef.CPU()
    offsets = ops.cast(input_row_offsets.to(host), DType.int64)
    count = ops.reshape(ops.shape_to_tensor([total_tokens]), [])
    tokens = ops.range(0, count, 1, out_dim=total_tokens, dtype=DType.int64, device=host)
    row_ends = ops.unsqueeze(offsets[1:], 0)
    rows = ops.reshape(ops.sum(ops.cast(ops.unsqueeze(tokens, 1) >= row_ends, DType.int64), axis=1), [total_tokens])
    starts = ops.gather(offsets, rows, axis=0)
    lengths = ops.gather(ops.cast(cache_lengths.to(host), DType.int64), rows, axis=0)
    return tokens - starts + lengths


@dataclass(frozen=True)
class CacheStep:
    """What every attention layer of one forward shares: the cache as mokv's
    ops take it, and each new token's row of MAX's `freqs_cis` (`[total_tokens,
    head_dim]`)."""

    cache: PagedCacheValues
    token_freqs: TensorValue

    @classmethod
    def prepare(
        cls,
        kv_collection: KVCacheInputsPerDevice,
        freqs_cis: TensorValue,
        input_row_offsets: TensorValue,
        total_tokens: DimLike,
    ) -> CacheStep:
        """Maps MAX's cache values (`mokv_cache_values`) and gathers the rotary
        rows at the positions of the step's `total_tokens` new tokens
        (`token_positions`)."""
        cache = mokv_cache_values(kv_collection)
        positions = token_positions(input_row_offsets, cache.cache_lengths, total_tokens)
        freqs = ops.gather(freqs_cis.to(DeviceRef.CPU()), positions, axis=0)
        return cls(cache, freqs.to(cache.device))


def rotate(x: TensorValue, token_freqs: TensorValue, interleaved: bool) -> TensorValue:
    """RoPE of `x` `[tokens, heads, head_dim]` by each token's `token_freqs`
    row (`[tokens, head_dim]`: (cos, sin) of each rotation pair), in x's dtype."""
    tokens, heads, head_dim = x.shape
    half = int(head_dim) // 2
    freqs = ops.reshape(ops.cast(token_freqs, x.dtype), [tokens, 1, half, 2])
    cos, sin = freqs[:, :, :, 0], freqs[:, :, :, 1]
    if interleaved:
        pairs = ops.reshape(x, [tokens, heads, half, 2])
        real, imag = pairs[:, :, :, 0], pairs[:, :, :, 1]
    else:
        real, imag = x[:, :, :half], x[:, :, half:]
    rotated_real = real * cos - imag * sin
    rotated_imag = real * sin + imag * cos
    if interleaved:
        return ops.reshape(ops.stack([rotated_real, rotated_imag], axis=-1), x.shape)
    return ops.concat([rotated_real, rotated_imag], axis=-1)


_PREPARED: weakref.WeakKeyDictionary[Graph, tuple[tuple[object, ...], CacheStep]] = weakref.WeakKeyDictionary()
"""Each graph's last prepared step, by the inputs it was prepared from."""

_MASKS = (MHAMaskVariant.CAUSAL_MASK, MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK)
"""The masks mokv's attention computes: causal, optionally over a sliding window."""


class _MokvAttention:
    """What the mokv twins share: MAX's layer call (`__call__`, ahead of the
    MAX class in each twin's bases), then RoPE, `store_kv` and `attention`;
    each twin projects the queries, keys and values as its MAX class does
    (`_project`)."""

    rope: object
    n_heads: int
    num_key_value_heads: int
    kv_params: object
    scale: float
    mask_variant: MHAMaskVariant
    o_proj: Module

    def __call__(
        self,
        layer_idx: TensorValue,
        x: TensorValue,
        kv_collection: KVCacheInputsPerDevice,
        freqs_cis: TensorValue,
        input_row_offsets: TensorValue,
    ) -> TensorValue:
        step = self._step(kv_collection, freqs_cis, input_row_offsets, x)
        q, k, v = self._project(x)
        return self._attend(layer_idx, q, k, v, step, input_row_offsets)

    def _project(self, x: TensorValue) -> tuple[TensorValue, TensorValue, TensorValue]:
        """The layer's query, key and value projections of `x` `[tokens, hidden]`."""
        raise NotImplementedError

    def _sliding_window(self) -> int:
        window = getattr(self, "sliding_window", None)
        if self.mask_variant not in _MASKS:
            raise ValueError(
                f"mask_variant={self.mask_variant.name}: mokv's attention is causal, optionally over a sliding window"
            )
        if self.mask_variant == MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK and not window:
            raise ValueError("mask_variant=SLIDING_WINDOW_CAUSAL_MASK needs sliding_window set")
        return int(window or 0)

    def _attend(
        self,
        layer_idx: TensorValue,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        step: CacheStep,
        input_row_offsets: TensorValue,
    ) -> TensorValue:
        """Rotates q and k, stores k and v at the step's positions, attends,
        and projects the heads back (`o_proj`)."""
        head_dim = self.kv_params.head_dim
        interleaved = bool(self.rope.interleaved)
        q = rotate(ops.reshape(q, [-1, self.n_heads, head_dim]), step.token_freqs, interleaved)
        k = rotate(ops.reshape(k, [-1, self.num_key_value_heads, head_dim]), step.token_freqs, interleaved)
        v = ops.reshape(v, [-1, self.num_key_value_heads, head_dim])
        offsets = input_row_offsets.to(step.cache.device)
        layer = layer_idx.to(DeviceRef.CPU())  # a host scalar, as MAX's layers get it and mokv's ops read it
        store_kv(step.cache, layer, k, v, offsets)
        out = attention(step.cache, layer, q, offsets, float(self.scale), self._sliding_window())
        return self.o_proj(ops.reshape(out, [q.shape[0], self.n_heads * head_dim]))

    @staticmethod
    def _step(
        kv_collection: KVCacheInputsPerDevice, freqs_cis: TensorValue, input_row_offsets: TensorValue, x: TensorValue
    ) -> CacheStep:
        """The graph's step for these inputs: prepared by the first layer that
        gets them, reused by the others (the same objects, in the same graph)."""
        inputs = (kv_collection, freqs_cis, input_row_offsets)
        prepared = _PREPARED.get(Graph.current)
        if prepared is None or any(a is not b for a, b in zip(prepared[0], inputs, strict=True)):
            prepared = inputs, CacheStep.prepare(kv_collection, freqs_cis, input_row_offsets, x.shape[0])
            _PREPARED[Graph.current] = prepared
        return prepared[1]


class MokvAttentionWithRope(_MokvAttention, AttentionWithRope):
    """MAX's `AttentionWithRope` (same constructor, weights and sharding) on mokv's ops."""

    def _project(self, x: TensorValue) -> tuple[TensorValue, TensorValue, TensorValue]:
        head_dim = self.kv_params.head_dim
        kv_dim = self.num_key_value_heads * head_dim
        q, k, v = ops.split(self.qkv_proj(x), [self.n_heads * head_dim, kv_dim, kv_dim], axis=-1)
        if self.use_qk_norm:  # per head, before RoPE, as MAX normalizes them
            q = ops.reshape(self.q_norm(ops.reshape(q, [-1, head_dim])), q.shape)
            k = ops.reshape(self.k_norm(ops.reshape(k, [-1, head_dim])), k.shape)
        return q, k, v

    def shard(self, devices: Iterable[DeviceRef]) -> list[AttentionWithRope]:
        """MAX's shards (the same weight slices), each on mokv's ops."""
        return [to_mokv(shard) for shard in super().shard(devices)]


class MokvGGUFQAttentionWithRope(_MokvAttention, GGUFQAttentionWithRope):
    """MAX's `GGUFQAttentionWithRope` (GGUF q4_0 / q4_k / q6_k weights, products
    by `ops.qmatmul`) on mokv's ops."""

    def _project(self, x: TensorValue) -> tuple[TensorValue, TensorValue, TensorValue]:
        q, k, v = (
            ops.qmatmul(weight.quantization_encoding, None, x, weight)
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        )
        return q, k, v


_TWINS: dict[type, type] = {
    AttentionWithRope: MokvAttentionWithRope,
    GGUFQAttentionWithRope: MokvGGUFQAttentionWithRope,
}
"""MAX's attention classes that mokv runs, and their twins."""


def to_mokv(layer: Module) -> Module:
    """Makes a built MAX attention layer run on mokv's ops, in place, and
    returns it: its class becomes the mokv twin, which adds no state, so its
    weights, names and sharding stay exactly as MAX built them. A mokv twin
    is returned as it is.

    Raises:
        TypeError: `layer` is no class mokv has a twin of (GPTQ and
            tensor-/data-parallel wrappers among them); the message names it.
    """
    if type(layer) in _TWINS.values():
        return layer
    twin = _TWINS.get(type(layer))
    if twin is None:
        supported = ", ".join(cls.__name__ for cls in _TWINS)
        raise TypeError(f"mokv runs MAX's {supported}, not {type(layer).__module__}.{type(layer).__qualname__}")
    layer.__class__ = twin
    return layer

"""The attention backend that runs on mokv's paged cache: each layer stores its
new K/V through the page table, then attends over the cache with mokv's flash
kernel. It declares the cache's graph inputs with the page size left symbolic,
so one compiled model serves caches of every page size.

The model computes in float32. A bfloat16 cache takes bfloat16 keys, values
and queries (cast on the way in, the output cast back); a quantized cache
(float8, int8) takes them in float32 and quantizes as it stores, its queries
and keys first rotated when its config says so (`rotate_keys`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from max.dtype import DType
from max.graph import BufferType, DeviceRef, TensorType, TensorValue, Value, ops

from mokv.contract import CacheShape, quant_config_of
from mokv.graph import PagedCacheValues, attention, paged_input_types, rotate_heads, store_kv
from mokv.kernels import kernel_package


class PagedCacheAttention:
    """`AttentionBackend` over a `PagedKVCacheManager`'s runtime inputs (the page tensor,
    cache_lengths, lookup_table, max_lengths), appended after the model's inputs;
    the cache lives on `device`, as the model does."""

    def __init__(self, cache_shape: CacheShape, device: DeviceRef | None = None) -> None:
        self.cache_shape = cache_shape
        self.device = device or DeviceRef.CPU()

    @property
    def custom_extensions(self) -> list[Path]:
        return [kernel_package()]

    def input_types(self) -> list[TensorType | BufferType]:
        return paged_input_types(self.cache_shape, device=self.device)

    def __call__(
        self,
        layer_idx: int,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        input_row_offsets: TensorValue,
        graph_inputs: Sequence[Value],
    ) -> TensorValue:
        cache = PagedCacheValues.from_inputs(graph_inputs)
        rows = DType.float32 if cache.quantized else self.cache_shape.dtype
        q, k, v = (x if x.dtype == rows else ops.cast(x, rows) for x in (q, k, v))
        config = quant_config_of(self.cache_shape)
        if config is not None and config.rotate_keys:
            q, k = rotate_heads(q), rotate_heads(k)
        store_kv(cache, layer_idx, k, v, input_row_offsets)
        scale = 1.0 / math.sqrt(int(q.shape[-1]))
        out = attention(cache, layer_idx, q, input_row_offsets, scale)
        return out if out.dtype == DType.float32 else ops.cast(out, DType.float32)

"""The cache as a model graph sees it: the input types to declare and the values
that carry one cache through the graph as a single argument.

Dimensions that change from batch to batch (batch size, pages, lookup-table
width, multi-step rows) are symbolic, so one compiled graph serves every batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from max.dtype import DType
from max.graph import (
    BufferType,
    BufferValue,
    DeviceRef,
    Dim,
    TensorType,
    TensorValue,
    Value,
)


class CacheShape(Protocol):
    """The parameters of a cache that fix its graph types (KVCacheParams has them)."""

    dtype: DType
    num_layers: int
    n_kv_heads: int
    head_dim: int


class CacheLayout(Protocol):
    """What every cache value offers the op wrappers: which op variant to call
    and the operands that stand for the cache in it."""

    layout: ClassVar[str]

    @property
    def device(self) -> DeviceRef: ...

    def operands(self) -> list[Value]: ...

    def row_type(self, rows: int | str | Dim) -> TensorType:
        """The type of `rows` token rows `[rows, kv_heads, head_dim]` of this cache."""
        ...


class _ComponentCache:
    """Shared by the caches passed as their component tensors."""

    blocks: BufferValue
    cache_lengths: TensorValue
    lookup_table: TensorValue

    @property
    def device(self) -> DeviceRef:
        return self.blocks.device

    def operands(self) -> list[Value]:
        return [self.blocks, self.cache_lengths, self.lookup_table]

    def row_type(self, rows: int | str | Dim) -> TensorType:
        shape = self.blocks.shape
        return TensorType(self.blocks.dtype, [rows, shape[4], shape[5]], self.blocks.device)


@dataclass(frozen=True)
class PagedCacheValues(_ComponentCache):
    """A paged cache inside a graph, in the order `runtime_inputs` produces it.

    `blocks` `[total_pages + 1, 2, layers, page_size, kv_heads, head_dim]`,
    `cache_lengths` uint32 `[batch]` (tokens cached before this step),
    `lookup_table` uint32 `[batch, max_pages_per_seq]` (page ids; unused
    entries hold the null page), `max_lengths` uint32 `[steps, 2]` (max new
    tokens, max context length per step).
    """

    layout: ClassVar[str] = "paged"
    blocks: BufferValue
    cache_lengths: TensorValue
    lookup_table: TensorValue
    max_lengths: TensorValue

    @classmethod
    def from_inputs(cls, values: Sequence[Value]) -> PagedCacheValues:
        """Wraps the four graph inputs declared by `paged_input_types`."""
        blocks, cache_lengths, lookup_table, max_lengths = values
        return cls(blocks.buffer, cache_lengths.tensor, lookup_table.tensor, max_lengths.tensor)


@dataclass(frozen=True)
class ContinuousCacheValues(_ComponentCache):
    """A continuous-batching cache inside a graph.

    `blocks` `[slots, 2, layers, max_seq_len, kv_heads, head_dim]`,
    `cache_lengths` uint32 `[batch]`, `lookup_table` uint32 `[batch]` (slot of
    each batch row), `is_cache_empty` a scalar bool.
    """

    layout: ClassVar[str] = "continuous"
    blocks: BufferValue
    cache_lengths: TensorValue
    lookup_table: TensorValue
    is_cache_empty: TensorValue

    @classmethod
    def from_inputs(cls, values: Sequence[Value]) -> ContinuousCacheValues:
        """Wraps the four graph inputs declared by `continuous_input_types`."""
        blocks, cache_lengths, lookup_table, is_cache_empty = values
        return cls(blocks.buffer, cache_lengths.tensor, lookup_table.tensor, is_cache_empty.tensor)


def paged_input_types(
    params: CacheShape, page_size: int | str = "page_size", device: DeviceRef | None = None
) -> list[BufferType | TensorType]:
    """Graph input types of a paged cache, in `PagedCacheValues` order.

    `page_size` may stay symbolic: the kernels read it at run time, so one
    compiled graph then serves every page size.
    """
    device = device or DeviceRef.CPU()
    return [
        BufferType(
            params.dtype,
            ["total_num_pages", 2, params.num_layers, page_size, params.n_kv_heads, params.head_dim],
            device,
        ),
        TensorType(DType.uint32, ["batch_size"], device),
        TensorType(DType.uint32, ["batch_size", "max_pages_per_seq"], device),
        TensorType(DType.uint32, ["num_steps", 2], DeviceRef.CPU()),
    ]


def continuous_input_types(
    params: CacheShape, max_seq_len: int | str = "max_seq_len", device: DeviceRef | None = None
) -> list[BufferType | TensorType]:
    """Graph input types of a continuous-batching cache, in `ContinuousCacheValues`
    order (`max_seq_len` may stay symbolic, as `page_size` in `paged_input_types`)."""
    device = device or DeviceRef.CPU()
    return [
        BufferType(
            params.dtype,
            ["num_slots", 2, params.num_layers, max_seq_len, params.n_kv_heads, params.head_dim],
            device,
        ),
        TensorType(DType.uint32, ["batch_size"], device),
        TensorType(DType.uint32, ["batch_size"], device),
        TensorType(DType.bool, [], DeviceRef.CPU()),
    ]

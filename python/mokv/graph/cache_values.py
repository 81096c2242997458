"""The cache as a model graph sees it: the contract's per-device records
(`mokv.contract`) holding graph values, plus what the op wrappers need from
them (the operands that stand for the cache).

Dimensions that change from batch to batch (batch size, pages, lookup-table
width, multi-step rows) are symbolic, so one compiled graph serves every batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, Self

from max.graph import BufferValue, DeviceRef, Dim, TensorType, TensorValue, Value

from ..contract import ContinuousCacheInputs, PagedCacheInputs


class CacheLayout(Protocol):
    """What every cache value offers the op wrappers: the operands that stand
    for the cache in an op."""

    @property
    def device(self) -> DeviceRef: ...

    def operands(self) -> list[Value]:
        """What every op takes for the cache: `blocks, cache_lengths,
        lookup_table`, or the opaque collection."""
        ...

    def dispatch_operand(self) -> Value | None:
        """The cache's fourth input, the host-side summary of the batch that
        attention checks every row against and plans from (it follows
        `operands()`): `max_lengths` or `is_cache_empty`. None when
        `operands()` carries it already, as the opaque collection does."""
        ...

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

    @classmethod
    def from_inputs(cls, values: Sequence[Value]) -> Self:
        """Wraps one device's graph inputs, declared by the contract's
        `paged_input_types` / `continuous_input_types`: the block buffer, then tensors."""
        expected = len(fields(cls))
        if len(values) != expected:
            raise ValueError(f"{cls.__name__}.from_inputs needs {expected} graph values, got {len(values)}")
        blocks, *tensors = values
        return cls(blocks.buffer, *(v.tensor for v in tensors))  # type: ignore[call-arg]


@dataclass(frozen=True)
class PagedCacheValues(_ComponentCache, PagedCacheInputs[Value]):
    """A paged cache inside a graph: one device's `PAGED_INPUTS` as graph values."""

    def dispatch_operand(self) -> Value:
        return self.max_lengths


@dataclass(frozen=True)
class ContinuousCacheValues(_ComponentCache, ContinuousCacheInputs[Value]):
    """A continuous-batching cache inside a graph: one device's `CONTINUOUS_INPUTS`."""

    def dispatch_operand(self) -> Value:
        return self.is_cache_empty

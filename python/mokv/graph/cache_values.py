"""The cache as a model graph sees it: the contract's per-device records
(`mokv.contract`) holding graph values, plus what the op wrappers need from
them (the operands that stand for the cache).

Dimensions that change from batch to batch (batch size, pages, lookup-table
width, multi-step rows) are symbolic, so one compiled graph serves every batch.

A quantized cache's values carry its `scales` buffer too (`quantized`), and the
ops take it right after `blocks` (the page or slot tensor).
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
        lookup_table` (`blocks, scales, cache_lengths, lookup_table` for a
        quantized cache), or the opaque collection."""
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
    scales: BufferValue | None

    @property
    def device(self) -> DeviceRef:
        return self.blocks.device

    @property
    def quantized(self) -> bool:
        """Whether the cache stores 8-bit values with scales (it has a `scales` input)."""
        return self.scales is not None

    def operands(self) -> list[Value]:
        if self.scales is not None:
            return [self.blocks, self.scales, self.cache_lengths, self.lookup_table]
        return [self.blocks, self.cache_lengths, self.lookup_table]

    def row_type(self, rows: int | str | Dim) -> TensorType:
        shape = self.blocks.shape
        return TensorType(self.blocks.dtype, [rows, shape[4], shape[5]], self.blocks.device)

    @classmethod
    def from_inputs(cls, values: Sequence[Value]) -> Self:
        """Wraps one device's graph inputs, declared by the contract's
        `paged_input_types` / `continuous_input_types`: the `blocks` buffer, then
        tensors, then (a quantized cache only) the scales buffer."""
        unquantized = len(fields(cls)) - 1  # every field but scales
        if len(values) not in (unquantized, unquantized + 1):
            raise ValueError(
                f"{cls.__name__}.from_inputs needs {unquantized} graph values "
                f"({unquantized + 1} for a quantized cache), got {len(values)}"
            )
        blocks, *tensors = values[:unquantized]
        scales = values[unquantized].buffer if len(values) > unquantized else None
        return cls(blocks.buffer, *(v.tensor for v in tensors), scales=scales)  # type: ignore[call-arg]


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

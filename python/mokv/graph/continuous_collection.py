"""The continuous-batching cache as one opaque graph value (MAX's `mo.opaque`
pattern): `FetchContinuousBatchingKVCacheCollection` turns the four tensors that
`ContinuousBatchingKVCacheManager.fetch` returns into a collection that every
store/gather op takes as a single operand."""

from __future__ import annotations

from typing import ClassVar

from max.graph import (
    DeviceRef,
    Dim,
    TensorType,
    TensorValue,
    Value,
    _OpaqueType,
    _OpaqueValue,
    ops,
)

from .cache_values import CacheShape


def ContinuousBatchingKVCacheCollectionType() -> _OpaqueType:
    """Graph type of the collection; names the Mojo struct that carries it."""
    return _OpaqueType("OpaqueContinuousCollection")


class ContinuousBatchingKVCacheCollection(_OpaqueValue):
    """The collection inside a graph: all layers' K and V caches of one batch."""

    layout: ClassVar[str] = "continuous_collection"

    def __init__(self, value: Value, params: CacheShape) -> None:
        super().__init__(value)
        self.params = params

    @property
    def device(self) -> DeviceRef:
        return DeviceRef.CPU()

    def operands(self) -> list[Value]:
        return [self]

    def row_type(self, rows: int | str | Dim) -> TensorType:
        p = self.params
        return TensorType(p.dtype, [rows, p.n_kv_heads, p.head_dim], self.device)


class FetchContinuousBatchingKVCacheCollection:
    """Builds the opaque collection from `(blocks, cache_lengths, lookup_table,
    is_cache_empty)` as declared by the manager's `input_symbols()`."""

    def __init__(self, kv_params: CacheShape) -> None:
        self.kv_params = kv_params

    def __call__(
        self,
        blocks: Value,
        cache_lengths: TensorValue,
        lookup_table: TensorValue,
        is_cache_empty: TensorValue,
    ) -> ContinuousBatchingKVCacheCollection:
        (collection,) = ops.inplace_custom(
            "mokv.collection.continuous",
            device=DeviceRef.CPU(),
            values=[blocks, cache_lengths, lookup_table, is_cache_empty],
            out_types=[ContinuousBatchingKVCacheCollectionType()],
        )
        return ContinuousBatchingKVCacheCollection(collection, self.kv_params)

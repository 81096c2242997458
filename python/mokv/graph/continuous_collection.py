"""The continuous-batching cache as one opaque graph value (MAX's `mo.opaque`
pattern): `FetchContinuousBatchingKVCacheCollection` turns the four tensors that
`ContinuousBatchingKVCacheManager.fetch` returns into a collection that every
store/gather/attention op takes as a single operand, and
`ContinuousBatchingKVCacheCollection.get_cache` takes one layer's keys or values
out of it as a `ContinuousBatchingKVCache`.

Quantized caches are not supported on this path yet (the collection carries no
scales): a graph over a quantized continuous cache takes its component inputs
(`continuous_input_types`, `ContinuousCacheValues`)."""

from __future__ import annotations

from max.dtype import DType
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

from ..contract import CacheShape, quant_config_of
from ..validation import check_int
from .arguments import check_vector


def ContinuousBatchingKVCacheCollectionType() -> _OpaqueType:
    """Graph type of the collection; names the Mojo struct that carries it."""
    return _OpaqueType("OpaqueContinuousCollection")


def ContinuousBatchingKVCacheType() -> _OpaqueType:
    """Graph type of one layer's keys or values; names the Mojo struct."""
    return _OpaqueType("OpaqueContinuousCache")


class ContinuousBatchingKVCache(_OpaqueValue):
    """One layer's keys or values of a batch's continuous-batching cache."""

    def __init__(
        self, value: Value, collection: ContinuousBatchingKVCacheCollection, layer_idx: int, kv_idx: int
    ) -> None:
        super().__init__(value)
        self.collection = collection
        self.layer_idx = layer_idx
        self.kv_idx = kv_idx

    def gather(self, batch_rows: TensorValue, positions: TensorValue) -> TensorValue:
        """Token `positions[i]` of batch row `batch_rows[i]` (both uint32 `[n]`)
        as a dense `[n, n_kv_heads, head_dim]` tensor."""
        check_vector("batch_rows", batch_rows)
        check_vector("positions", positions)
        (rows,) = ops.inplace_custom(
            "mokv.gather.continuous_cache",
            device=self.collection.device,
            values=[self, batch_rows, positions],
            out_types=[self.collection.row_type(positions.shape[0])],
        )
        return rows.tensor


class ContinuousBatchingKVCacheCollection(_OpaqueValue):
    """The collection inside a graph: all layers' K and V caches of one batch."""

    def __init__(self, value: Value, params: CacheShape) -> None:
        super().__init__(value)
        self.params = params

    @property
    def device(self) -> DeviceRef:
        return DeviceRef.CPU()

    def operands(self) -> list[Value]:
        return [self]

    def dispatch_operand(self) -> None:
        """None: the collection carries `is_cache_empty` itself."""
        return None

    def row_type(self, rows: int | str | Dim) -> TensorType:
        p = self.params
        return TensorType(p.dtype, [rows, p.n_kv_heads_per_device, p.head_dim], self.device)

    def get_cache(self, layer_idx: int, kv_idx: int) -> ContinuousBatchingKVCache:
        """Layer `layer_idx`'s keys (`kv_idx` 0) or values (1)."""
        check_int("layer_idx", layer_idx, minimum=0, maximum=self.params.num_layers - 1)
        check_int("kv_idx", kv_idx, minimum=0, maximum=1)
        (cache,) = ops.inplace_custom(
            "mokv.collection.continuous.get_cache",
            device=self.device,
            values=[
                self,
                ops.constant(layer_idx, DType.uint32, device=self.device),
                ops.constant(kv_idx, DType.uint32, device=self.device),
            ],
            out_types=[ContinuousBatchingKVCacheType()],
        )
        return ContinuousBatchingKVCache(cache, self, layer_idx, kv_idx)


class FetchContinuousBatchingKVCacheCollection:
    """Builds the opaque collection from `(blocks, cache_lengths, lookup_table,
    is_cache_empty)` as declared by the manager's `input_symbols()`.

    Raises:
        ValueError: `kv_params` is a quantized cache's (`kvcache_quant_config`
            set), which the collection does not support yet.
    """

    def __init__(self, kv_params: CacheShape) -> None:
        if quant_config_of(kv_params) is not None:
            raise ValueError(
                "the opaque continuous-batching collection does not support quantized caches yet "
                f"(kvcache_quant_config={quant_config_of(kv_params)!r}): build the graph on the cache's "
                "component inputs (continuous_input_types, ContinuousCacheValues.from_inputs) instead"
            )
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

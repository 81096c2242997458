"""The opaque continuous-batching collection: built once per graph from the four
fetched tensors, then handed to every store/gather/attention op as a single
operand; and the opaque per-layer cache (one layer's keys or values) that
`get_cache` takes out of it. The two structs are the opaque values' types
(their names are the graph's opaque type names); the ops make and use them."""

import extensibility
from extensibility import InputTensor, OutputTensor, _MutableInputTensor
from max.gpu.host import DeviceContext

from .attention.op import attention_on
from .bind import bind_collection, check_layer, layer_cache
from .cache.batch_summary import BatchSummary
from .cache.collection import ContinuousBatchingKVCacheCollection
from .cache.kv_cache import ContinuousBatchingKVCache
from .cache.layout import CacheGeometry, ContinuousLayout
from .store import gather_rows_on, store_kv_on


@fieldwise_init
struct OpaqueContinuousCollection(TrivialRegisterPassable):
    """A continuous-batching collection carried through a graph as one opaque
    value. MAX 26.7 cannot put a DType parameter on an opaque graph type, so the
    dtype travels as a field and `typed` checks it against the consumer's."""

    var geometry: CacheGeometry
    var dtype: DType
    var is_cache_empty: Bool

    def typed[dtype: DType](self) raises -> ContinuousBatchingKVCacheCollection[dtype]:
        if self.dtype != dtype:
            raise Error(
                t"the cache collection holds {self.dtype} but the op was given {dtype} tensors"
            )
        return ContinuousBatchingKVCacheCollection[dtype](self.geometry, ContinuousLayout())


@fieldwise_init
struct OpaqueContinuousCache(TrivialRegisterPassable):
    """One layer's keys or values of an opaque continuous-batching collection,
    itself carried through a graph as one opaque value."""

    var collection: OpaqueContinuousCollection
    var layer: Int
    var kv_idx: Int

    def typed[dtype: DType](self) raises -> ContinuousBatchingKVCache[dtype]:
        return self.collection.typed[dtype]().get_cache(self.layer, self.kv_idx)


@extensibility.register("mokv.collection.continuous")
struct FetchContinuousCollection:
    """Turns (blocks, cache_lengths, lookup_table, is_cache_empty) into the
    opaque collection value."""

    @staticmethod
    def execute[
        dtype: DType, target: StaticString
    ](
        blocks: _MutableInputTensor[dtype=dtype, rank=6, ...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, ...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=1, ...],
        is_cache_empty: Scalar[DType.bool],
        ctx: DeviceContext,
    ) raises -> OpaqueContinuousCollection:
        var typed = bind_collection(blocks, cache_lengths, lookup_table)
        return OpaqueContinuousCollection(typed.geometry, dtype, Bool(is_cache_empty))


@extensibility.register("mokv.store_kv.continuous_collection")
struct StoreKVContinuousCollection:
    """`mokv.store_kv` taking the opaque collection."""

    @staticmethod
    def execute[
        dtype: DType, target: StaticString
    ](
        collection: OpaqueContinuousCollection,
        keys: InputTensor[dtype=dtype, rank=3, ...],
        values: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        store_kv_on[target](
            ctx, collection.typed[dtype](), layer_idx, keys, values, input_row_offsets
        )


@extensibility.register("mokv.gather.continuous_collection")
struct GatherContinuousCollection:
    """`mokv.gather` taking the opaque collection."""

    @staticmethod
    def execute[
        dtype: DType, target: StaticString
    ](
        dest: OutputTensor[dtype=dtype, rank=3, ...],
        collection: OpaqueContinuousCollection,
        batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
        positions: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        kv_idx: UInt32,
        ctx: DeviceContext,
    ) raises:
        var cache = layer_cache(collection.typed[dtype](), layer_idx, kv_idx)
        gather_rows_on[target](ctx, cache, dest, batch_rows, positions)


@extensibility.register("mokv.attention.continuous_collection")
struct AttentionContinuousCollection:
    """`mokv.attention` taking the opaque collection, whose `is_cache_empty`
    is the batch summary."""

    @staticmethod
    def execute[
        dtype: DType, target: StaticString
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        collection: OpaqueContinuousCollection,
        q: InputTensor[dtype=dtype, rank=3, ...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
        layer_idx: UInt32,
        scale: Float32,
        sliding_window: UInt32,
        ctx: DeviceContext,
    ) raises:
        attention_on[target](
            ctx,
            collection.typed[dtype](),
            BatchSummary.of_is_cache_empty(collection.is_cache_empty),
            output,
            q,
            input_row_offsets,
            layer_idx,
            scale,
            sliding_window,
        )


@extensibility.register("mokv.collection.continuous.get_cache")
struct GetContinuousCache:
    """Layer `layer_idx`'s keys (`kv_idx` 0) or values (1) of the collection,
    as an opaque per-layer cache value."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        collection: OpaqueContinuousCollection,
        layer_idx: UInt32,
        kv_idx: UInt32,
        ctx: DeviceContext,
    ) raises -> OpaqueContinuousCache:
        check_layer(Int(layer_idx), collection.geometry.num_layers)
        if kv_idx > 1:
            raise Error(t"kv_idx must be 0 (keys) or 1 (values), got {kv_idx}")
        return OpaqueContinuousCache(collection, Int(layer_idx), Int(kv_idx))


@extensibility.register("mokv.gather.continuous_cache")
struct GatherContinuousCache:
    """`mokv.gather` reading one opaque per-layer cache."""

    @staticmethod
    def execute[
        dtype: DType, target: StaticString
    ](
        dest: OutputTensor[dtype=dtype, rank=3, ...],
        cache: OpaqueContinuousCache,
        batch_rows: InputTensor[dtype=DType.uint32, rank=1, ...],
        positions: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        gather_rows_on[target](ctx, cache.typed[dtype](), dest, batch_rows, positions)

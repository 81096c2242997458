"""Compile check of every GPU path of mokv's ops, for a machine without a GPU.

`tools/check_gpu_build.sh` builds this file with `mojo build
--target-accelerator <arch>`: that instantiates every registered op's
`execute` (`mokv.store_kv`, `mokv.gather`, `mokv.attention` for both cache
layouts, the opaque continuous-collection ops, and the quantized-cache ops
with float32 and bfloat16 rows, `mokv.gather.codes` included) with
`target="gpu"`, as MAX does for a graph on a GPU, for both dtypes, and
compiles all the kernels they launch (every head size and tile shape the
attention dispatches to at runtime, on CUDA cores and tensor cores, and the
split-K merge) to device code. A compile error in any GPU path fails
the build. The binary is not meant to be run: the tensors it builds are empty.
"""

from max.gpu.host import DeviceContext
from std.sys import argv
from std.utils import IndexList

from mokv_kernels.attention.op import Attention, AttentionQuantized
from mokv_kernels.opaque_collection import (
    AttentionContinuousCollection,
    FetchContinuousCollection,
    GatherContinuousCache,
    GatherContinuousCollection,
    GetContinuousCache,
    StoreKVContinuousCollection,
)
from mokv_kernels.store import Gather, GatherCodes, GatherQuantized, StoreKV, StoreKVQuantized
from mokv_kernels.gpu.views import InputView, MutableView, OutputView, row_major


def _ptr[
    dtype: DType
](ctx: DeviceContext, count: Int) raises -> Pointer[Scalar[dtype], MutUntrackedOrigin]:
    var buffer = ctx.enqueue_create_buffer[dtype](count)
    var ptr = buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    _ = buffer^
    return ptr


def _view[dtype: DType, rank: Int](ctx: DeviceContext, n: Int) raises -> InputView[dtype, rank]:
    var shape = IndexList[rank](fill=n)
    return InputView[dtype, rank](_ptr[dtype](ctx, 1), shape, row_major(shape))


def _output[dtype: DType](ctx: DeviceContext, n: Int) raises -> OutputView[dtype, 3]:
    var shape = IndexList[3](fill=n)
    return OutputView[dtype, 3](_ptr[dtype](ctx, 1), shape, row_major(shape))


def _registered_ops[dtype: DType](ctx: DeviceContext, n: Int) raises:
    comptime gpu: StaticString = "gpu"
    var shape = IndexList[6](n, 2, n, n, n, n)
    var blocks = MutableView[dtype, 6](_ptr[dtype](ctx, 1), shape, row_major(shape))
    var lengths = _view[DType.uint32, 1](ctx, n)
    var page_table = _view[DType.uint32, 2](ctx, n)
    var max_lengths = _view[DType.uint32, 2](ctx, n)
    var is_cache_empty = _view[DType.bool, 1](ctx, n)
    var tokens = _view[dtype, 3](ctx, n)
    var index = _view[DType.uint32, 1](ctx, n)
    var out = _output[dtype](ctx, n)
    var layer = UInt32(n - 1)
    var scale = Float32(n)

    # The ops over the graph's tensors: paged (a rank-2 lookup table), then
    # continuous batching (a rank-1 one).
    StoreKV.execute[dtype, 2, gpu](blocks, lengths, page_table, tokens, tokens, index, layer, ctx)
    Gather.execute[dtype, 2, gpu](out, blocks, lengths, page_table, index, index, layer, layer, ctx)
    Attention.execute[dtype, 2, DType.uint32, 2, gpu](
        out, blocks, lengths, page_table, max_lengths, tokens, index, layer, scale, layer, ctx
    )
    StoreKV.execute[dtype, 1, gpu](blocks, lengths, lengths, tokens, tokens, index, layer, ctx)
    Gather.execute[dtype, 1, gpu](out, blocks, lengths, lengths, index, index, layer, layer, ctx)
    Attention.execute[dtype, 1, DType.bool, 1, gpu](
        out, blocks, lengths, lengths, is_cache_empty, tokens, index, layer, scale, layer, ctx
    )

    # The ops over the opaque continuous-batching collection.
    var collection = FetchContinuousCollection.execute[dtype, gpu](
        blocks, lengths, lengths, Scalar[DType.bool](n == 1), ctx
    )
    StoreKVContinuousCollection.execute[dtype, gpu](collection, tokens, tokens, index, layer, ctx)
    GatherContinuousCollection.execute[dtype, gpu](out, collection, index, index, layer, layer, ctx)
    AttentionContinuousCollection.execute[dtype, gpu](
        out, collection, tokens, index, layer, scale, layer, ctx
    )
    var cache = GetContinuousCache.execute[gpu](collection, layer, layer, ctx)
    GatherContinuousCache.execute[dtype, gpu](out, cache, index, index, ctx)


def _quantized_ops[cache_dtype: DType, dtype: DType](ctx: DeviceContext, n: Int) raises:
    """The quantized-cache ops over a paged cache of `cache_dtype` codes
    (uint8: float8 bits; int8), rows and queries of `dtype`."""
    comptime gpu: StaticString = "gpu"
    var shape = IndexList[6](n, 2, n, n, n, n)
    var blocks = MutableView[cache_dtype, 6](_ptr[cache_dtype](ctx, 1), shape, row_major(shape))
    var scales = MutableView[DType.float32, 6](_ptr[DType.float32](ctx, 1), shape, row_major(shape))
    var lengths = _view[DType.uint32, 1](ctx, n)
    var page_table = _view[DType.uint32, 2](ctx, n)
    var max_lengths = _view[DType.uint32, 2](ctx, n)
    var tokens = _view[dtype, 3](ctx, n)
    var index = _view[DType.uint32, 1](ctx, n)
    var out = _output[dtype](ctx, n)
    var layer = UInt32(n - 1)
    StoreKVQuantized.execute[dtype, cache_dtype, 2, gpu](
        blocks, scales, lengths, page_table, tokens, tokens, index, layer, ctx
    )
    GatherQuantized.execute[dtype, cache_dtype, 2, gpu](
        out, blocks, scales, lengths, page_table, index, index, layer, layer, ctx
    )
    AttentionQuantized.execute[dtype, cache_dtype, 2, DType.uint32, 2, gpu](
        out,
        blocks,
        scales,
        lengths,
        page_table,
        max_lengths,
        tokens,
        index,
        layer,
        Float32(n),
        layer,
        ctx,
    )


def _gather_codes[cache_dtype: DType](ctx: DeviceContext, n: Int) raises:
    """`mokv.gather.codes` over a paged cache of `cache_dtype` codes."""
    comptime gpu: StaticString = "gpu"
    var shape = IndexList[6](n, 2, n, n, n, n)
    var blocks = MutableView[cache_dtype, 6](_ptr[cache_dtype](ctx, 1), shape, row_major(shape))
    var scales = MutableView[DType.float32, 6](_ptr[DType.float32](ctx, 1), shape, row_major(shape))
    var index = _view[DType.uint32, 1](ctx, n)
    GatherCodes.execute[cache_dtype, 2, gpu](
        _output[cache_dtype](ctx, n),
        _output[DType.float32](ctx, n),
        blocks,
        scales,
        index,
        _view[DType.uint32, 2](ctx, n),
        index,
        index,
        UInt32(n - 1),
        UInt32(n - 1),
        ctx,
    )


def main() raises:
    # Every size comes from the command line, so that the compiler can
    # neither prove a check fails nor that it passes: it must keep (and
    # compile) every launch behind them.
    var n = len(argv())
    var ctx = DeviceContext()
    _registered_ops[DType.float32](ctx, n)
    _registered_ops[DType.bfloat16](ctx, n)
    comptime for c in range(2):
        comptime codes = DType.uint8 if c == 0 else DType.int8
        _quantized_ops[codes, DType.float32](ctx, n)
        _quantized_ops[codes, DType.bfloat16](ctx, n)
        _gather_codes[codes](ctx, n)

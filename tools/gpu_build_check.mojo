"""Compile check of every GPU path of mokv's ops, for a machine without a GPU.

`tools/check_gpu_build.sh` builds this file with `mojo build
--target-accelerator <arch>`: that instantiates the ops' store, gather and
attention paths for a GPU target (`store_kv_on["gpu"]` and its siblings, as
the registered ops call them) for both cache layouts and both dtypes (every head
size and tile shape the attention dispatches to at runtime, and the split-K
merge), and compiles all their kernels to device code. A compile error in any
GPU path fails the build. The binary is not meant to be run: the tensors it
builds are empty.
"""

from max.gpu.host import DeviceContext
from std.sys import argv
from std.utils import IndexList

from mokv_kernels.bind import bind_collection
from mokv_kernels.cache import BatchSummary, KVCollectionT
from mokv_kernels.attention.op import attention_on
from mokv_kernels.store import gather_on, store_kv_on
from mokv_kernels.gpu.views import InputView, MutableView, OutputView, row_major


def _ptr[
    dtype: DType
](ctx: DeviceContext, count: Int) raises -> Pointer[Scalar[dtype], MutUntrackedOrigin]:
    var buffer = ctx.enqueue_create_buffer[dtype](count)
    var ptr = buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    _ = buffer^
    return ptr


def _ops[collection_t: KVCollectionT](ctx: DeviceContext, collection: collection_t, n: Int) raises:
    comptime dtype = collection_t.CacheType.dtype
    var rows = IndexList[3](n, n, n)
    var keys = InputView[dtype, 3](_ptr[dtype](ctx, 1), rows, row_major(rows))
    var q = InputView[dtype, 3](_ptr[dtype](ctx, 1), rows, row_major(rows))
    var out = OutputView[dtype, 3](_ptr[dtype](ctx, 1), rows, row_major(rows))
    var index = InputView[DType.uint32, 1](
        _ptr[DType.uint32](ctx, 1), IndexList[1](n), IndexList[1](1)
    )
    var offsets = InputView[DType.uint32, 1](
        _ptr[DType.uint32](ctx, 1), IndexList[1](n + 1), IndexList[1](1)
    )
    var layer = UInt32(n - 1)
    store_kv_on["gpu"](ctx, collection, layer, keys, keys, offsets)
    gather_on["gpu"](ctx, collection, out, layer, layer, index, index)
    var summary = BatchSummary.of_max_lengths(n, n)
    attention_on["gpu"](ctx, collection, summary, out, q, offsets, layer, Float32(n), layer)


def _both_layouts[dtype: DType](ctx: DeviceContext, n: Int) raises:
    var shape = IndexList[6](n, 2, n, n, n, n)
    var blocks = MutableView[dtype, 6](_ptr[dtype](ctx, 1), shape, row_major(shape))
    var lengths = InputView[DType.uint32, 1](
        _ptr[DType.uint32](ctx, 1), IndexList[1](n), IndexList[1](1)
    )
    var table = InputView[DType.uint32, 2](
        _ptr[DType.uint32](ctx, 1), IndexList[2](n, n), IndexList[2](n, 1)
    )
    _ops(ctx, bind_collection(blocks, lengths, table), n)
    _ops(ctx, bind_collection(blocks, lengths, lengths), n)


def main() raises:
    # Every size comes from the command line, so that the compiler can
    # neither prove a check fails nor that it passes: it must keep (and
    # compile) every launch behind them.
    var n = len(argv())
    var ctx = DeviceContext()
    _both_layouts[DType.float32](ctx, n)
    _both_layouts[DType.bfloat16](ctx, n)
